//! coverage.py's JSON report (`--cov-report=json:PATH`, test-frameworks.md §3.6).
//!
//! `totals.percent_covered` mixes statements and branches when branch coverage is on, so it is
//! not used: lines (= statements for coverage.py) come from `percent_statements_covered` or
//! `covered_lines / num_statements`, branches from `percent_branches_covered` or
//! `covered_branches / num_branches`. `overall`, the figure compared with the target, is the
//! line percentage. coverage.py has no function total, so `functions` stays absent.

use std::collections::HashMap;

use serde::Deserialize;
use troupe_proto::v1::Coverage;

#[derive(Debug, Deserialize)]
struct Report {
    totals: Summary,
    #[serde(default)]
    files: HashMap<String, File>,
}

#[derive(Debug, Deserialize)]
struct File {
    summary: Summary,
}

#[derive(Debug, Default, Deserialize)]
struct Summary {
    #[serde(default)]
    covered_lines: u64,
    #[serde(default)]
    num_statements: u64,
    #[serde(default)]
    percent_statements_covered: Option<f64>,
    #[serde(default)]
    num_branches: Option<u64>,
    #[serde(default)]
    covered_branches: Option<u64>,
    #[serde(default)]
    percent_branches_covered: Option<f64>,
}

impl Summary {
    fn lines(&self) -> f64 {
        self.percent_statements_covered
            .unwrap_or_else(|| percent(self.covered_lines, self.num_statements))
    }

    fn branches(&self) -> Option<f64> {
        match (
            self.percent_branches_covered,
            self.num_branches,
            self.covered_branches,
        ) {
            (Some(pct), Some(n), _) if n > 0 => Some(pct),
            (None, Some(n), Some(covered)) if n > 0 => Some(percent(covered, n)),
            _ => None,
        }
    }
}

/// `covered / total` in percent; nothing to cover counts as fully covered, as coverage.py does.
fn percent(covered: u64, total: u64) -> f64 {
    if total == 0 {
        100.0
    } else {
        // Counts of lines fit in f64's exact integer range.
        #[allow(clippy::cast_precision_loss)]
        let pct = covered as f64 * 100.0 / total as f64;
        pct
    }
}

/// Parses a coverage.py JSON report into percentages.
pub(crate) fn parse(text: &str) -> Result<Coverage, serde_json::Error> {
    let report: Report = serde_json::from_str(text)?;
    let lines = report.totals.lines();
    Ok(Coverage {
        lines: Some(lines),
        statements: Some(lines),
        branches: report.totals.branches(),
        functions: None,
        overall: Some(lines),
        files: report
            .files
            .into_iter()
            .map(|(path, file)| (path, file.summary.lines()))
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uses_statement_and_branch_percentages_not_the_mixed_total() {
        // From test-frameworks.md §3.6 (coverage 7.17.3 with --cov-branch).
        let text = r#"{"meta": {"format": 3, "branch_coverage": true},
          "totals": {"covered_lines": 15, "num_statements": 26, "percent_covered": 47.05882352941177,
                     "percent_statements_covered": 57.69230769230769, "num_branches": 8,
                     "covered_branches": 1, "percent_branches_covered": 12.5},
          "files": {"src/calc/mathops.py": {"summary": {"covered_lines": 8, "num_statements": 14, "percent_covered": 45.0}}}}"#;
        let coverage = parse(text).expect("coverage parses");
        let lines = coverage.lines.expect("lines");
        assert!((lines - 57.692_307).abs() < 1e-4, "{lines}");
        assert_eq!(coverage.overall, coverage.lines);
        assert_eq!(coverage.branches, Some(12.5));
        assert_eq!(coverage.functions, None);
        // Older coverage.py: computed from the counts.
        let file = coverage.files["src/calc/mathops.py"];
        assert!((file - 8.0 * 100.0 / 14.0).abs() < 1e-9, "{file}");
    }

    #[test]
    fn no_branches_means_no_branch_figure() {
        let text = r#"{"totals": {"covered_lines": 0, "num_statements": 0, "num_branches": 0}, "files": {}}"#;
        let coverage = parse(text).expect("coverage parses");
        assert_eq!(coverage.lines, Some(100.0));
        assert_eq!(coverage.branches, None);
    }
}
