//! Routing by capability: a task whose backend is named goes only to a worker that offers
//! that backend or one of the task's own fallbacks (`backend:<name>` among its claim's
//! capabilities). What a task needs is decided once, at intake
//! ([`troupe_plan::backend::routes`]), and stored with it (`tasks.backends`), so a claim
//! filters on a column instead of reading plan objects.

use troupe_proto::v1 as pb;

/// The backends a claim offers: `None` when its worker declares none (it may be given any
/// task: workers that predate routing, and roles whose tasks are not routed).
pub(crate) type Offer = Option<Vec<String>>;

/// What a claim asks for: its roles (any when empty) and its offer. Claims asking for the
/// same filter share one read of ready tasks.
pub(crate) type Filter<'a> = (&'a [pb::Role], Option<&'a [String]>);

/// Whether a worker offering `offer` may run a task that needs one of `routes` (empty: any).
pub(crate) fn can_run(offer: Option<&[String]>, routes: &[String]) -> bool {
    match offer {
        None => true,
        Some(offer) => routes.is_empty() || routes.iter().any(|name| offer.contains(name)),
    }
}

/// The stored form of `routes`: `|claude|codex|` (so one `LIKE '%|claude|%'` finds it), or
/// `None` for any worker.
pub(crate) fn to_column(routes: &[String]) -> Option<String> {
    (!routes.is_empty()).then(|| format!("|{}|", routes.join("|")))
}

/// Reads the stored form back.
pub(crate) fn from_column(column: Option<&str>) -> Vec<String> {
    column
        .unwrap_or_default()
        .split('|')
        .filter(|name| !name.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The SQL condition that keeps the tasks a worker offering `offer` may run, on `column`,
/// with parameters numbered from `first`, and the values to bind to them in order. Backend
/// names are lowercase letters (`troupe_backends::BACKEND_NAMES`), so no `LIKE` escapes.
pub(crate) fn sql_filter(
    column: &str,
    offer: Option<&[String]>,
    first: usize,
) -> (String, Vec<String>) {
    let Some(offer) = offer else {
        return (String::new(), Vec::new());
    };
    let mut parts = vec![format!("{column} IS NULL")];
    let mut binds = Vec::with_capacity(offer.len());
    for (i, name) in offer.iter().enumerate() {
        parts.push(format!("{column} LIKE ${}", first + i));
        binds.push(format!("%|{name}|%"));
    }
    (format!(" AND ({})", parts.join(" OR ")), binds)
}

/// Whether any of the live workers' offers (`offers`) can run a task that needs `routes`.
pub(crate) fn served(offers: &[Offer], routes: &[String]) -> bool {
    offers.iter().any(|offer| can_run(offer.as_deref(), routes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|name| (*name).to_owned()).collect()
    }

    #[test]
    fn a_worker_runs_the_backend_or_a_fallback_the_task_names() {
        let claude_only = names(&["agent", "claude", "command"]);
        let codex_only = names(&["agent", "codex", "command"]);
        let claude_task = names(&["claude"]);
        assert!(can_run(Some(&claude_only), &claude_task));
        assert!(!can_run(Some(&codex_only), &claude_task));
        assert!(can_run(Some(&codex_only), &names(&["claude", "codex"])));
        // Any worker runs an auto task; a worker that declares nothing runs anything.
        assert!(can_run(Some(&codex_only), &[]));
        assert!(can_run(Some(&[]), &[]));
        assert!(can_run(None, &claude_task));
        assert!(!can_run(Some(&[]), &claude_task));
        assert!(served(&[Some(codex_only.clone()), None], &claude_task));
        assert!(!served(&[Some(codex_only)], &claude_task));
        assert!(!served(&[], &claude_task));
    }

    #[test]
    fn the_column_and_the_sql_filter_agree() {
        let routes = names(&["claude", "codex"]);
        let column = to_column(&routes);
        assert_eq!(column.as_deref(), Some("|claude|codex|"));
        assert_eq!(from_column(column.as_deref()), routes);
        assert_eq!(to_column(&[]), None);
        assert!(from_column(None).is_empty());
        assert_eq!(
            sql_filter("t.backends", None, 3),
            (String::new(), Vec::new())
        );
        assert_eq!(
            sql_filter("backends", Some(&names(&["codex", "gemini"])), 4),
            (
                " AND (backends IS NULL OR backends LIKE $4 OR backends LIKE $5)".to_owned(),
                names(&["%|codex|%", "%|gemini|%"])
            )
        );
        assert_eq!(
            sql_filter("backends", Some(&[]), 2),
            (" AND (backends IS NULL)".to_owned(), Vec::new())
        );
    }
}
