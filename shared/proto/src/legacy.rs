//! Reads results stored before some closed sets became enums. Those fields were strings
//! (`"pass"`, `"gaps_found"`, `"kept"`, ...); they keep their numbers as `legacy_*` fields that
//! nothing writes, and [`upgrade_result`] / [`upgrade_convergence`] move a stored value into
//! its enum, so a coordinator's store written by an older version reads as if written today.

#![allow(deprecated)] // the `legacy_*` fields exist to be read here

use crate::names::{Named, parse};
use crate::v1::{TaskConvergence, TaskResult, task_result};

/// Moves `legacy` into `value` when `value` is unset, and clears `legacy`.
fn upgrade<T: Named + Into<i32>>(legacy: &mut String, value: &mut i32) {
    if *value == 0
        && let Some(parsed) = parse::<T>(legacy)
    {
        *value = parsed.into();
    }
    legacy.clear();
}

/// Upgrades a stored task result in place.
pub fn upgrade_result(result: &mut TaskResult) {
    use crate::v1::{ConvergenceMet, ErrorKind, FixStrategy, FixVerdict, GapType, Severity};
    use crate::v1::{TaskState, VerificationStatus};
    let validation = |report: &mut crate::v1::ValidationReport| {
        for check in &mut report.checks {
            upgrade::<crate::v1::CheckKind>(&mut check.legacy_kind, &mut check.kind);
        }
        for finding in report
            .review
            .iter_mut()
            .flat_map(|review| review.findings.iter_mut())
        {
            upgrade::<crate::v1::ReviewDimension>(
                &mut finding.legacy_dimension,
                &mut finding.dimension,
            );
        }
        upgrade::<ConvergenceMet>(
            &mut report.legacy_convergence_met,
            &mut report.convergence_met,
        );
        for upstream in &mut report.upstream_convergence {
            upgrade::<ConvergenceMet>(
                &mut upstream.legacy_convergence_met,
                &mut upstream.convergence_met,
            );
        }
        if let Some(verification) = report.verification.as_mut() {
            upgrade::<VerificationStatus>(
                &mut verification.legacy_status,
                &mut verification.status,
            );
            for gap in &mut verification.gaps {
                upgrade::<GapType>(&mut gap.legacy_type, &mut gap.r#type);
            }
        }
    };
    match result.detail.as_mut() {
        Some(task_result::Detail::Validation(report)) => validation(report),
        Some(task_result::Detail::Implementation(report)) => {
            if let Some(own) = report.self_validation.as_mut() {
                validation(own);
            }
            for part in &mut report.phase_tasks {
                upgrade::<TaskState>(&mut part.legacy_state, &mut part.state);
                upgrade::<ConvergenceMet>(
                    &mut part.legacy_convergence_met,
                    &mut part.convergence_met,
                );
            }
        }
        Some(task_result::Detail::TestRun(report)) => {
            for failure in &mut report.failures {
                upgrade::<Severity>(&mut failure.legacy_criticality, &mut failure.criticality);
            }
            for iteration in report
                .fix_loop
                .iter_mut()
                .flat_map(|fix| fix.iterations.iter_mut())
            {
                upgrade::<FixStrategy>(&mut iteration.legacy_strategy, &mut iteration.strategy);
                upgrade::<FixVerdict>(&mut iteration.legacy_verdict, &mut iteration.verdict);
                upgrade::<ErrorKind>(&mut iteration.legacy_error_kind, &mut iteration.error_kind);
            }
        }
        None => {}
    }
}

/// Upgrades a stored task convergence in place.
pub fn upgrade_convergence(convergence: &mut TaskConvergence) {
    upgrade::<crate::v1::ConvergenceMet>(&mut convergence.legacy_met, &mut convergence.met);
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use crate::v1::{
        ConvergenceMet, FixIteration, FixLoopReport, FixVerdict, GoalVerification, TestRunReport,
        ValidationReport, VerificationStatus,
    };

    /// A result as an older version stored it: the closed sets as strings.
    #[test]
    fn results_stored_with_strings_read_as_enums() {
        let old = TaskResult {
            detail: Some(task_result::Detail::Validation(ValidationReport {
                legacy_convergence_met: "pending".into(),
                checks: vec![crate::v1::CheckResult {
                    legacy_kind: "criterion".into(),
                    ..Default::default()
                }],
                review: Some(crate::v1::ReviewReport {
                    findings: vec![crate::v1::ReviewFinding {
                        legacy_dimension: "security".into(),
                        ..Default::default()
                    }],
                    ..Default::default()
                }),
                verification: Some(GoalVerification {
                    legacy_status: "gaps_found".into(),
                    ..GoalVerification::default()
                }),
                ..ValidationReport::default()
            })),
            ..TaskResult::default()
        };
        let mut read = TaskResult::decode(old.encode_to_vec().as_slice()).expect("decodes");
        upgrade_result(&mut read);
        let Some(task_result::Detail::Validation(report)) = read.detail else {
            panic!("validation");
        };
        assert_eq!(report.convergence_met(), ConvergenceMet::Pending);
        assert!(report.legacy_convergence_met.is_empty());
        assert_eq!(report.checks[0].kind(), crate::v1::CheckKind::Criterion);
        let review = report.review.as_ref().expect("review");
        assert_eq!(
            review.findings[0].dimension(),
            crate::v1::ReviewDimension::Security
        );
        let verification = report.verification.expect("verification");
        assert_eq!(verification.status(), VerificationStatus::GapsFound);

        let mut fix = TaskResult {
            detail: Some(task_result::Detail::TestRun(TestRunReport {
                fix_loop: Some(FixLoopReport {
                    iterations: vec![FixIteration {
                        legacy_verdict: "reverted_worse".into(),
                        legacy_error_kind: "rate_limited".into(),
                        ..FixIteration::default()
                    }],
                    ..FixLoopReport::default()
                }),
                ..TestRunReport::default()
            })),
            ..TaskResult::default()
        };
        upgrade_result(&mut fix);
        let Some(task_result::Detail::TestRun(run)) = fix.detail else {
            panic!("test run");
        };
        let iteration = &run.fix_loop.expect("fix loop").iterations[0];
        assert_eq!(iteration.verdict(), FixVerdict::RevertedWorse);
        assert_eq!(iteration.error_kind(), crate::v1::ErrorKind::RateLimited);

        let mut convergence = TaskConvergence {
            legacy_met: "fail".into(),
            ..TaskConvergence::default()
        };
        upgrade_convergence(&mut convergence);
        assert_eq!(convergence.met(), ConvergenceMet::Fail);
    }
}
