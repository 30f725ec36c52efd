//! Self-validation (ccw-reference §1.B.9–10): after the agent's change is committed, the
//! validator service checks the task's own commit with its files, verification command and
//! convergence criteria, plus a syntax check of the changed files.

use std::time::Duration;

use troupe_proto::v1::validator_client::ValidatorClient;
use troupe_proto::v1::{CheckStatus, ConvergenceMet, ValidateRequest, ValidationReport};

use crate::spec::TaskSpec;

/// Syntax failures fed back to the agent before the task fails (CCW: at most 3 retries).
pub(crate) const MAX_SYNTAX_RETRIES: u32 = 3;

/// How long one `Validate` call may take: the verification command alone may use 300 s.
const VALIDATE_DEADLINE: Duration = Duration::from_secs(900);

/// Calls `Validate` on `url` for `commit` measured against `base`, with `connector`'s
/// credentials.
#[tracing::instrument(name = "troupe.self_validation", skip_all, fields(commit = %commit))]
pub(crate) async fn validate(
    connector: &troupe_grpc::Connector,
    url: &str,
    repo_path: &str,
    commit: &str,
    base: &str,
    spec: &TaskSpec,
) -> Result<ValidationReport, String> {
    let channel = connector.channel(url).map_err(|err| err.to_string())?;
    let mut client =
        ValidatorClient::with_interceptor(channel, connector.outbound(VALIDATE_DEADLINE))
            .max_decoding_message_size(connector.max_message())
            .max_encoding_message_size(connector.max_message());
    let files = spec
        .files
        .iter()
        .map(troupe_plan::FileSpec::to_proto)
        .collect();
    let mut request = tonic::Request::new(ValidateRequest {
        repo_path: repo_path.to_owned(),
        r#ref: commit.to_owned(),
        files,
        base_ref: base.to_owned(),
        verification: spec
            .blocks
            .convergence
            .verification
            .clone()
            .unwrap_or_default(),
        criteria: spec.blocks.convergence.criteria.clone(),
        syntax: true,
        ..ValidateRequest::default()
    });
    request.set_timeout(VALIDATE_DEADLINE);
    let response = client
        .validate(request)
        .await
        .map_err(|status| format!("{:?}: {}", status.code(), status.message()))?;
    response
        .into_inner()
        .report
        .ok_or_else(|| "the validator returned no report".to_owned())
}

/// The syntax checks that failed, as `name: evidence` lines for the agent.
pub(crate) fn syntax_failures(report: &ValidationReport) -> Vec<String> {
    report
        .checks
        .iter()
        .filter(|check| {
            check.kind() == troupe_proto::v1::CheckKind::Syntax
                && (check.status == CheckStatus::Fail as i32
                    || check.status == CheckStatus::Error as i32)
        })
        .map(|check| format!("{}: {}", check.name, check.evidence.trim()))
        .collect()
}

/// The prompt of a retry after a failed syntax check.
pub(crate) fn feedback_prompt(prompt: &str, round: u32, failures: &[String]) -> String {
    format!(
        "{prompt}\nSELF-VALIDATION FAILED (retry {round} of {MAX_SYNTAX_RETRIES}): the syntax check \
         rejected your change. Fix these errors and keep the rest of the work:\n{}\n",
        failures
            .iter()
            .map(|f| format!("- {f}"))
            .collect::<Vec<_>>()
            .join("\n")
    )
}

/// `convergence-met` of a report for a summary: `pending` when nothing checked the criteria.
pub(crate) fn convergence_met(report: Option<&ValidationReport>) -> &'static str {
    match report.map(ValidationReport::convergence_met) {
        None | Some(ConvergenceMet::Unspecified) => "pending",
        Some(met) => troupe_proto::names::name(met),
    }
}

#[cfg(test)]
mod tests {
    use troupe_proto::v1::CheckResult;

    use super::*;

    #[test]
    fn only_failed_syntax_checks_are_fed_back() {
        use troupe_proto::v1::CheckKind;
        let check = |kind: CheckKind, status: CheckStatus| CheckResult {
            name: format!("{}:a.py", troupe_proto::names::name(kind)),
            kind: kind as i32,
            status: status as i32,
            evidence: " line 2: invalid syntax \n".into(),
            ..CheckResult::default()
        };
        let report = ValidationReport {
            checks: vec![
                check(CheckKind::Syntax, CheckStatus::Fail),
                check(CheckKind::Syntax, CheckStatus::Pass),
                check(CheckKind::File, CheckStatus::Fail),
            ],
            ..ValidationReport::default()
        };
        let failures = syntax_failures(&report);
        assert_eq!(failures, ["syntax:a.py: line 2: invalid syntax"]);
        let prompt = feedback_prompt("PURPOSE: x\n", 2, &failures);
        assert!(prompt.contains("retry 2 of 3"), "{prompt}");
        assert!(prompt.ends_with("- syntax:a.py: line 2: invalid syntax\n"));
        assert_eq!(convergence_met(None), "pending");
    }
}
