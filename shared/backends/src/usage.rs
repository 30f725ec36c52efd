//! An attempt's token usage so far, over all of its backend runs (retries, fallbacks, an EXEC
//! phase's parts running side by side, a test fix loop's agents), told to the worker as it
//! grows so its heartbeats can carry it.

use std::sync::{Arc, Mutex};

use crate::{Usage, UsageSink};

/// Told the name of each backend as its run starts.
type BackendNamed = Arc<dyn Fn(&str) + Send + Sync>;

/// Adds up the usage each backend run reports so far into the attempt's total.
#[derive(Clone)]
pub struct UsageMeter {
    total: Arc<Mutex<Usage>>,
    report: Arc<dyn Fn(Usage) + Send + Sync>,
    backend: Option<BackendNamed>,
}

impl std::fmt::Debug for UsageMeter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UsageMeter")
            .field("total", &self.total())
            .finish_non_exhaustive()
    }
}

impl UsageMeter {
    /// A meter telling `report` the attempt's total each time it grows.
    pub fn new(report: impl Fn(Usage) + Send + Sync + 'static) -> Self {
        Self {
            total: Arc::new(Mutex::new(Usage::default())),
            report: Arc::new(report),
            backend: None,
        }
    }

    /// Also tells `backend` the name of each backend as its run starts.
    pub fn with_backend(mut self, backend: impl Fn(&str) + Send + Sync + 'static) -> Self {
        self.backend = Some(Arc::new(backend));
        self
    }

    /// The attempt's total so far.
    pub fn total(&self) -> Usage {
        self.total.lock().map(|t| *t).unwrap_or_default()
    }

    /// A sink for one run of `backend`: each report is that run's usage so far (cumulative
    /// within the run), of which only the growth since its previous report is added.
    pub fn run_sink(&self, backend: &str) -> UsageSink {
        if let Some(tell) = &self.backend {
            tell(backend);
        }
        let meter = self.clone();
        let seen = Mutex::new(Usage::default());
        UsageSink::new(move |usage: Usage| {
            let Ok(mut seen) = seen.lock() else { return };
            let grew = |now: u64, before: u64| now.saturating_sub(before);
            let delta = Usage {
                input_tokens: grew(usage.input_tokens, seen.input_tokens),
                output_tokens: grew(usage.output_tokens, seen.output_tokens),
                cached_input_tokens: grew(usage.cached_input_tokens, seen.cached_input_tokens),
            };
            *seen = usage;
            let total = {
                let Ok(mut total) = meter.total.lock() else {
                    return;
                };
                total.input_tokens += delta.input_tokens;
                total.output_tokens += delta.output_tokens;
                total.cached_input_tokens += delta.cached_input_tokens;
                *total
            };
            if delta != Usage::default() {
                (meter.report)(total);
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(input: u64, output: u64) -> Usage {
        Usage {
            input_tokens: input,
            output_tokens: output,
            cached_input_tokens: 0,
        }
    }

    #[test]
    fn runs_add_up_by_their_growth_and_only_growth_is_reported() {
        let told = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&told);
        let backends = Arc::new(Mutex::new(Vec::new()));
        let named = Arc::clone(&backends);
        let meter = UsageMeter::new(move |u| sink.lock().unwrap().push(u))
            .with_backend(move |name| named.lock().unwrap().push(name.to_owned()));
        let first = meter.run_sink("codex");
        first.report(usage(100, 10));
        first.report(usage(100, 10)); // unchanged: not told again
        first.report(usage(250, 30));
        // A second run (a retry, or a phase part beside the first) starts from zero.
        let second = meter.run_sink("claude");
        second.report(usage(50, 5));
        first.report(usage(260, 31));
        assert_eq!(meter.total(), usage(310, 36));
        assert_eq!(
            *told.lock().unwrap(),
            [
                usage(100, 10),
                usage(250, 30),
                usage(300, 35),
                usage(310, 36)
            ]
        );
        assert_eq!(*backends.lock().unwrap(), ["codex", "claude"]);
    }
}
