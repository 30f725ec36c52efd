//! The executor's backend configuration file (TOML).
//!
//! ```toml
//! fallback = ["gemini", "qwen", "codex"]   # tried in order after a classified failure
//! retries = 1                              # extra attempts per backend on retryable errors
//! retry_backoff_ms = 500                   # doubled after each retry
//! auto_backend = "codex"                   # auto mode for Medium/High complexity
//!
//! [backends.codex]
//! command = "/opt/npm/bin/codex"            # default: the backend name on PATH
//! model = "gpt-5.5"
//! endpoint = "http://127.0.0.1:8080/v1"     # OpenAI Responses base URL
//! api_key_env = "OPENAI_API_KEY"           # our variable whose value the child gets as its key
//! auth = "auto"                            # auto | key | login | none (docs/agent-clis.md)
//! login_dir = "/etc/troupe/codex-login"    # the CLI's login files (a mounted Secret); default ~
//! env_allow = ["HTTPS_PROXY"]              # extra variables passed through
//! timeout_seconds = 1800
//! idle_timeout_seconds = 300
//! fast_fail = true                         # switch the CLI's own retries off
//! sandbox = "enforce"                      # this backend's children: enforce | warn | off
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// Settings for one backend.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    /// Program to run (path or name on `PATH`); default the CLI's usual name.
    pub command: Option<String>,
    /// Model name passed to the CLI (or the `agent` loop).
    pub model: Option<String>,
    /// Base URL of the model endpoint, in the form the CLI's protocol expects
    /// (codex/qwen/opencode/agent: `.../v1`; claude and gemini: no path).
    pub endpoint: Option<String>,
    /// API key, literally (prefer `api_key_env`).
    pub api_key: Option<String>,
    /// Name of one of our environment variables holding the API key.
    pub api_key_env: Option<String>,
    /// Where the CLI's credential comes from (default `auto`: the configured key if there is
    /// one, else the user's login).
    #[serde(default)]
    pub auth: AuthMode,
    /// A directory holding the CLI's login files by name (`auth.json`, `.credentials.json`,
    /// `oauth_creds.json`, ...; a mounted Secret), instead of the user's home.
    pub login_dir: Option<PathBuf>,
    /// Extra variables of ours the child may see (beyond PATH, LANG and the like).
    #[serde(default)]
    pub env_allow: Vec<String>,
    /// Variables set for the child.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Wall-clock limit per run.
    pub timeout_seconds: Option<u64>,
    /// Limit on time without output.
    pub idle_timeout_seconds: Option<u64>,
    /// Turn the CLI's own retries off where the CLI lets us (tests; troupe retries and falls
    /// back itself): codex provider retries 0 (its unbounded reconnects are always off),
    /// `CLAUDE_CODE_MAX_RETRIES=0`, gemini `general.maxAttempts: 1`, qwen
    /// `model.generationConfig.maxRetries: 0`. Not switchable (read in their sources): qwen's
    /// inner 7-attempt backoff on 5xx and network errors and opencode's 5 session retries
    /// (about 70–90 s each before the CLI gives up).
    #[serde(default)]
    pub fast_fail: bool,
    /// `agent` loop: most model calls per run.
    pub max_turns: Option<u32>,
    /// `agent` loop: most tokens (input + output) per run.
    pub max_tokens: Option<u64>,
    /// `agent` loop: programs the `run` tool may start (argv\[0\]).
    pub allow_commands: Option<Vec<String>>,
    /// This backend's Landlock confinement (`enforce`, `warn`, `off`), instead of the
    /// service's `--sandbox`.
    pub sandbox: Option<String>,
}

/// Where a CLI's credential comes from.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum AuthMode {
    /// The configured key if there is one, else the user's login.
    #[default]
    Auto,
    /// Only the configured key (`api_key` / `api_key_env`).
    Key,
    /// Only the user's login files, copied into the run's private home.
    Login,
    /// No credential (an endpoint that needs none).
    None,
}

impl BackendConfig {
    /// The API key from `api_key` or `api_key_env`.
    pub fn key(&self) -> Option<String> {
        self.api_key.clone().or_else(|| {
            self.api_key_env
                .as_deref()
                .and_then(|name| std::env::var(name).ok())
        })
    }

    /// The sandbox mode this backend's settings ask for (validated when the file is read).
    pub fn sandbox_mode(&self) -> Option<troupe_process::SandboxMode> {
        self.sandbox.as_deref().and_then(|mode| mode.parse().ok())
    }

    /// The wall-clock limit, when set.
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout_seconds.map(Duration::from_secs)
    }

    /// The idle limit, when set.
    pub fn idle_timeout(&self) -> Option<Duration> {
        self.idle_timeout_seconds.map(Duration::from_secs)
    }
}

/// The whole file.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct BackendsConfig {
    /// Backends tried, in order, after a classified failure (CCW: gemini → qwen → codex).
    #[serde(default = "default_fallback")]
    pub fallback: Vec<String>,
    /// Extra attempts with the same backend on retryable errors.
    #[serde(default = "default_retries")]
    pub retries: u32,
    /// First backoff between retries; doubles each time.
    #[serde(default = "default_backoff")]
    pub retry_backoff_ms: u64,
    /// Backend for auto mode when the task is not Low complexity (CCW: codex).
    #[serde(default = "default_auto")]
    pub auto_backend: String,
    /// Per-backend settings, by backend name.
    #[serde(default)]
    pub backends: BTreeMap<String, BackendConfig>,
}

fn default_fallback() -> Vec<String> {
    vec!["gemini".to_owned(), "qwen".to_owned(), "codex".to_owned()]
}

fn default_retries() -> u32 {
    1
}

fn default_backoff() -> u64 {
    500
}

fn default_auto() -> String {
    "codex".to_owned()
}

impl Default for BackendsConfig {
    fn default() -> Self {
        Self {
            fallback: default_fallback(),
            retries: default_retries(),
            retry_backoff_ms: default_backoff(),
            auto_backend: default_auto(),
            backends: BTreeMap::new(),
        }
    }
}

/// A configuration file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Reading the file failed.
    #[error("cannot read backend config {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The TOML is malformed or has unknown keys.
    #[error("invalid backend config {path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
}

impl BackendsConfig {
    /// Parses TOML text; `origin` names it in errors.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let config: Self = toml::from_str(text).map_err(|err| ConfigError::Parse {
            path: origin.to_owned(),
            message: err.to_string(),
        })?;
        for (name, backend) in &config.backends {
            // The key reaches the backend's child only; anywhere troupe writes, it is masked.
            if let Some(key) = backend.key() {
                troupe_telemetry::register_secret(key);
            }
            let cli = crate::CliKind::from_name(name).is_some();
            if !cli && (backend.auth == AuthMode::Login || backend.login_dir.is_some()) {
                return Err(ConfigError::Parse {
                    path: origin.to_owned(),
                    message: format!(
                        "backends.{name}: `{name}` has no login (auth = \"login\" and login_dir are for codex, claude, gemini, qwen and opencode)"
                    ),
                });
            }
            if let Some(mode) = &backend.sandbox
                && let Err(message) = mode.parse::<troupe_process::SandboxMode>()
            {
                return Err(ConfigError::Parse {
                    path: origin.to_owned(),
                    message: format!("backends.{name}.sandbox: {message}"),
                });
            }
        }
        for name in config.backends.keys().chain(config.fallback.iter()) {
            if !crate::BACKEND_NAMES.contains(&name.as_str()) {
                return Err(ConfigError::Parse {
                    path: origin.to_owned(),
                    message: format!(
                        "unknown backend `{name}` (known: {})",
                        crate::BACKEND_NAMES.join(", ")
                    ),
                });
            }
        }
        Ok(config)
    }

    /// Reads and parses a file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_toml(&text, &path.display().to_string())
    }

    /// Settings for `name` (defaults when the file says nothing).
    pub fn backend(&self, name: &str) -> BackendConfig {
        self.backends.get(name).cloned().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects_unknown_names() {
        let config = BackendsConfig::from_toml(
            "retries = 0\n[backends.codex]\nmodel = \"gpt-5.5\"\nendpoint = \"http://x/v1\"\nfast_fail = true\ntimeout_seconds = 30\n",
            "t.toml",
        )
        .expect("valid");
        assert_eq!(config.retries, 0);
        assert_eq!(config.fallback, ["gemini", "qwen", "codex"]);
        let codex = config.backend("codex");
        assert_eq!(codex.model.as_deref(), Some("gpt-5.5"));
        assert_eq!(codex.timeout(), Some(Duration::from_secs(30)));
        assert!(codex.fast_fail);
        assert_eq!(config.backend("gemini"), BackendConfig::default());

        let err = BackendsConfig::from_toml("[backends.nope]\n", "t.toml").expect_err("unknown");
        assert!(err.to_string().contains("unknown backend `nope`"), "{err}");
        let err =
            BackendsConfig::from_toml("[backends.codex]\nmodle = 1\n", "t.toml").expect_err("typo");
        assert!(err.to_string().contains("modle"), "{err}");
        let warn = BackendsConfig::from_toml("[backends.codex]\nsandbox = \"warn\"\n", "t.toml")
            .expect("valid");
        assert_eq!(
            warn.backend("codex").sandbox_mode(),
            Some(troupe_process::SandboxMode::Warn)
        );
        let err = BackendsConfig::from_toml("[backends.codex]\nsandbox = \"loose\"\n", "t.toml")
            .expect_err("bad mode");
        assert!(
            err.to_string().contains("unknown sandbox mode `loose`"),
            "{err}"
        );
    }
}
