//! The price table the workers count cost by (`--model-prices`, `TROUPE_MODEL_PRICES`): a TOML
//! file of USD per million tokens, per model, as the provider bills them:
//!
//! ```toml
//! [models."gpt-5-mini"]
//! input = 0.25          # prompt tokens not served from the cache
//! output = 2.0
//! cached_input = 0.025  # optional; cached prompt tokens cost `input` without it
//! ```
//!
//! A model the table does not name costs nothing in the metrics (its tokens still count).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, RwLock};

use troupe_proto::v1::Usage;

use crate::Error;

/// USD per million tokens of one model.
#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// Prompt tokens not served from the provider's cache.
    pub input: f64,
    /// Generated tokens.
    pub output: f64,
    /// Prompt tokens served from the cache (defaults to `input`).
    pub cached_input: Option<f64>,
}

/// Prices by model name.
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Prices {
    /// The models priced.
    #[serde(default)]
    pub models: BTreeMap<String, Price>,
}

impl Prices {
    /// Parses a price table, refusing prices that are negative or not numbers.
    pub fn parse(text: &str) -> Result<Self, String> {
        let prices: Self = toml::from_str(text).map_err(|err| err.to_string())?;
        for (model, price) in &prices.models {
            for (what, value) in [
                ("input", Some(price.input)),
                ("output", Some(price.output)),
                ("cached_input", price.cached_input),
            ] {
                if let Some(value) = value
                    && !(value.is_finite() && value >= 0.0)
                {
                    return Err(format!(
                        "model {model:?}: {what} must be a price of 0 or more, not {value}"
                    ));
                }
            }
        }
        Ok(prices)
    }

    /// Reads and parses the table at `path`.
    pub fn load(path: &Path) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path).map_err(|err| {
            Error::Config(format!("reading the price table {}: {err}", path.display()))
        })?;
        Self::parse(&text).map_err(|why| {
            Error::Config(format!(
                "the price table {} is invalid: {why}",
                path.display()
            ))
        })
    }

    /// What `usage` of `model` cost in USD; `None` for a model the table does not name.
    pub fn cost(&self, model: &str, usage: &Usage) -> Option<f64> {
        let price = self.models.get(model)?;
        let cached = usage.cached_input_tokens.min(usage.input_tokens);
        let fresh = usage.input_tokens - cached;
        // Token counts far below 2^53: exact as f64.
        #[allow(clippy::cast_precision_loss)]
        let cost = fresh as f64 * price.input
            + cached as f64 * price.cached_input.unwrap_or(price.input)
            + usage.output_tokens as f64 * price.output;
        Some(cost / 1_000_000.0)
    }
}

/// The process's table: the workers of `troupe up` share it.
fn table() -> &'static RwLock<Arc<Prices>> {
    static TABLE: std::sync::OnceLock<RwLock<Arc<Prices>>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| RwLock::new(Arc::new(Prices::default())))
}

/// Makes `prices` the table costs are counted by.
pub(crate) fn set(prices: Prices) {
    *table().write().unwrap_or_else(|poison| poison.into_inner()) = Arc::new(prices);
}

/// The table in force.
pub(crate) fn current() -> Arc<Prices> {
    Arc::clone(&table().read().unwrap_or_else(|poison| poison.into_inner()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cost_bills_fresh_cached_and_generated_tokens_per_million() {
        let prices = Prices::parse(
            "[models.\"m-1\"]\ninput = 2.0\noutput = 8.0\ncached_input = 0.5\n\
             [models.plain]\ninput = 1.0\noutput = 1.0\n",
        )
        .expect("parses");
        let usage = Usage {
            input_tokens: 1_000,
            output_tokens: 500,
            cached_input_tokens: 400,
        };
        // 600 fresh at 2, 400 cached at 0.5, 500 generated at 8, per million.
        let cost = prices.cost("m-1", &usage).expect("priced");
        assert!((cost - (600.0 * 2.0 + 400.0 * 0.5 + 500.0 * 8.0) / 1e6).abs() < 1e-12);
        // Without a cached price, cached tokens cost the input price.
        let plain = prices.cost("plain", &usage).expect("priced");
        assert!((plain - 1_500.0 / 1e6).abs() < 1e-12);
        assert_eq!(prices.cost("unknown", &usage), None);
    }

    #[test]
    fn bad_tables_are_refused_with_the_reason() {
        let negative = Prices::parse("[models.m]\ninput = -1.0\noutput = 1.0\n").unwrap_err();
        assert!(
            negative.contains("input must be a price of 0 or more"),
            "{negative}"
        );
        let unknown =
            Prices::parse("[models.m]\ninput = 1.0\noutput = 1.0\nfoo = 2\n").unwrap_err();
        assert!(unknown.contains("foo"), "{unknown}");
        let missing = Prices::parse("[models.m]\ninput = 1.0\n").unwrap_err();
        assert!(missing.contains("output"), "{missing}");
    }
}
