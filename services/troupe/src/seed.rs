//! Seeding an empty remote from a plan's template: `troupe run PLAN --repo NAME=URL` for a
//! `template` repository pushes the template as the remote's first commit when the remote has
//! no branch yet, so a sample plan runs with workers on other machines. The push uses this
//! user's own git setup (credential helpers, SSH agent): it happens on the submitting machine.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;
use tokio_util::sync::CancellationToken;
use troupe_process::Command;

/// Variables the user's git needs to reach their remotes, passed through to it.
const GIT_ENV: &[&str] = &[
    "SSH_AUTH_SOCK",
    "GIT_SSH_COMMAND",
    "GIT_ASKPASS",
    "SSH_ASKPASS",
];

async fn git(args: &[&str], cwd: &Path) -> Result<String, String> {
    let mut command = Command::new("git").args(args.iter().copied()).cwd(cwd);
    for name in GIT_ENV {
        command = command.env_passthrough(*name);
    }
    let output = command
        .env("GIT_TERMINAL_PROMPT", "0")
        .timeout(std::time::Duration::from_secs(300))
        .run(&CancellationToken::new())
        .await
        .map_err(|err| err.to_string())?;
    if output.success() {
        Ok(output.stdout_text())
    } else {
        Err(troupe_process::tail(&output.stderr_text(), 5, 1000))
    }
}

/// For each template repository of `plan_json` given a URL in `overrides`, pushes the template
/// (as `main`) to that URL when it has no branch. Returns what it seeded, for a line each.
pub async fn seed_templates(
    plan_json: &str,
    base_dir: &Path,
    overrides: &HashMap<String, String>,
) -> Result<Vec<String>, String> {
    let plan: Value = serde_json::from_str(plan_json).map_err(|err| err.to_string())?;
    let Some(repos) = plan["repos"].as_object() else {
        return Ok(Vec::new());
    };
    let mut seeded = Vec::new();
    for (index, (name, spec)) in repos.iter().enumerate() {
        let Some(template) = spec["template"].as_str() else {
            continue;
        };
        let url = overrides
            .get(name)
            .or_else(|| if index == 0 { overrides.get("") } else { None });
        let Some(url) = url.filter(|url| url.contains("://")) else {
            continue;
        };
        let heads = git(&["ls-remote", "--heads", "--end-of-options", url], base_dir)
            .await
            .map_err(|err| format!("repo `{name}`: {url} is unreachable: {err}"))?;
        if !heads.trim().is_empty() {
            continue;
        }
        let scratch = tempfile::tempdir().map_err(|err| err.to_string())?;
        let repo = troupe_workspace::Repo::init_from_template(
            base_dir.join(template),
            scratch.path().join(name),
        )
        .await
        .map_err(|err| format!("repo `{name}`: template {template}: {err}"))?;
        git(
            &[
                "push",
                "--quiet",
                "--end-of-options",
                url,
                "main:refs/heads/main",
            ],
            repo.path(),
        )
        .await
        .map_err(|err| format!("repo `{name}`: could not seed {url} from {template}: {err}"))?;
        seeded.push(format!(
            "seeded {url} with template {template} (repo {name})"
        ));
    }
    Ok(seeded)
}
