//! Where a CLI's credential comes from (`auth = "auto" | "key" | "login" | "none"`), and the
//! user's login brought into a run's private home.
//!
//! A login is the CLI's own credential files (docs/agent-clis.md): codex `auth.json`, claude
//! `.credentials.json`, gemini `oauth_creds.json` and `google_accounts.json`, qwen
//! `oauth_creds.json`, opencode `auth.json`. Only those files are copied, from the user's home
//! (at the path the CLI itself uses) or from `login_dir` (a mounted Secret, files by name),
//! never the rest of HOME. A file the CLI rewrote during the run (a refreshed token) is written
//! back atomically, unless the source changed meanwhile (another run refreshed it first); then
//! the copies are removed, so no saved session home keeps a token.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::config::AuthMode;
use crate::{BackendConfig, CliKind};

/// One login file of a CLI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoginFile {
    /// Where it is read from (the user's home or `login_dir`).
    pub source: PathBuf,
    /// Where it goes, relative to the run's home (the CLI's own layout under troupe's homes).
    pub run_path: &'static str,
    /// Whether the login is incomplete without it.
    pub required: bool,
}

/// Where a backend's credential comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Credential {
    /// An API key: the configured one (`key` set), or a variable of the CLI's own that the
    /// configuration passes through (`key` unset).
    Key {
        /// The key troupe hands the child, when it hands one.
        key: Option<String>,
        /// Where it comes from, for `doctor` (never the key).
        source: String,
    },
    /// The user's login files.
    Login {
        /// The files, each copied into the run's home.
        files: Vec<LoginFile>,
    },
    /// No credential on purpose (`auth = "none"`).
    None,
    /// None found: the run fails as `AUTH` with this message (which says how to fix it).
    Missing {
        /// What is missing and how to provide it.
        reason: String,
    },
}

impl Credential {
    /// One line for `troupe doctor`: where the credential comes from.
    pub fn describe(&self) -> String {
        match self {
            Self::Key { source, .. } => format!("key: {source}"),
            Self::Login { files } => format!(
                "login: {}",
                files
                    .iter()
                    .filter(|f| f.source.is_file())
                    .map(|f| f.source.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Self::None => "none (auth = \"none\")".to_owned(),
            Self::Missing { reason } => format!("missing: {reason}"),
        }
    }

    /// Whether the run uses the user's login.
    pub fn is_login(&self) -> bool {
        matches!(self, Self::Login { .. })
    }
}

/// The variables of its own from which each CLI takes a key.
fn key_vars(kind: CliKind) -> &'static [&'static str] {
    match kind {
        CliKind::Codex => &["CODEX_API_KEY", "OPENAI_API_KEY"],
        CliKind::Claude => &[
            "ANTHROPIC_API_KEY",
            "ANTHROPIC_AUTH_TOKEN",
            "CLAUDE_CODE_OAUTH_TOKEN",
        ],
        CliKind::Gemini => &["GEMINI_API_KEY", "GOOGLE_API_KEY"],
        CliKind::Qwen => &["OPENAI_API_KEY"],
        CliKind::Opencode => &["OPENAI_API_KEY", "ANTHROPIC_API_KEY"],
    }
}

/// How a user signs the CLI in.
fn sign_in(kind: CliKind) -> &'static str {
    match kind {
        CliKind::Codex => "`codex login`",
        CliKind::Claude => "`claude` then `/login`",
        CliKind::Gemini => "`gemini` then \"Login with Google\"",
        CliKind::Qwen => "`qwen` then `/auth`",
        CliKind::Opencode => "`opencode auth login`",
    }
}

fn env_dir(var: &str) -> Option<PathBuf> {
    std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

fn user_home() -> PathBuf {
    env_dir("HOME").unwrap_or_else(|| PathBuf::from("/root"))
}

/// The CLI's login files: in `login_dir` by file name, else where the CLI keeps them for the
/// user troupe runs as (honouring the CLI's own home variable).
pub fn login_files(kind: CliKind, login_dir: Option<&Path>) -> Vec<LoginFile> {
    let home = user_home();
    let at = |dir: Option<PathBuf>, default: &str| dir.unwrap_or_else(|| home.join(default));
    let (dir, files): (PathBuf, &[(&str, &'static str, bool)]) = match kind {
        CliKind::Codex => (
            at(env_dir("CODEX_HOME"), ".codex"),
            &[("auth.json", ".codex/auth.json", true)],
        ),
        CliKind::Claude => (
            at(env_dir("CLAUDE_CONFIG_DIR"), ".claude"),
            &[(".credentials.json", ".claude/.credentials.json", true)],
        ),
        CliKind::Gemini => (
            at(env_dir("GEMINI_CLI_HOME"), "").join(".gemini"),
            &[
                ("oauth_creds.json", "gemini/.gemini/oauth_creds.json", true),
                (
                    "google_accounts.json",
                    "gemini/.gemini/google_accounts.json",
                    false,
                ),
            ],
        ),
        CliKind::Qwen => (
            at(env_dir("QWEN_HOME"), ".qwen"),
            &[("oauth_creds.json", ".qwen/oauth_creds.json", true)],
        ),
        CliKind::Opencode => (
            at(env_dir("XDG_DATA_HOME"), ".local/share").join("opencode"),
            &[("auth.json", ".local/share/opencode/auth.json", true)],
        ),
    };
    let dir = login_dir.map_or(dir, Path::to_path_buf);
    files
        .iter()
        .map(|(name, run_path, required)| LoginFile {
            source: dir.join(name),
            run_path,
            required: *required,
        })
        .collect()
}

/// Where `kind`'s credential comes from under `config`.
pub fn resolve(kind: CliKind, config: &BackendConfig) -> Credential {
    let name = kind.name();
    let key = || -> Option<Credential> {
        if let Some(key) = &config.api_key {
            return Some(Credential::Key {
                key: Some(key.clone()),
                source: format!("api_key in [backends.{name}]"),
            });
        }
        if let Some(var) = &config.api_key_env
            && let Ok(key) = std::env::var(var)
            && !key.is_empty()
        {
            return Some(Credential::Key {
                key: Some(key),
                source: format!("${var} (api_key_env)"),
            });
        }
        let vars = key_vars(kind);
        if let Some(var) = config.env.keys().find(|k| vars.contains(&k.as_str())) {
            return Some(Credential::Key {
                key: None,
                source: format!("{var} in [backends.{name}.env]"),
            });
        }
        config
            .env_allow
            .iter()
            .find(|v| vars.contains(&v.as_str()) && env_dir(v).is_some())
            .map(|var| Credential::Key {
                key: None,
                source: format!("${var} (env_allow)"),
            })
    };
    let files = login_files(kind, config.login_dir.as_deref());
    let login = || -> Option<Credential> {
        files
            .iter()
            .all(|f| !f.required || f.source.is_file())
            .then(|| Credential::Login {
                files: files.clone(),
            })
    };
    let looked = files
        .iter()
        .filter(|f| f.required)
        .map(|f| f.source.display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let no_key = match &config.api_key_env {
        Some(var) => format!("${var} (api_key_env) is not set"),
        None => format!("no api_key or api_key_env in [backends.{name}]"),
    };
    let login_fix = format!(
        "sign in with {} as the user troupe runs as, or set login_dir in [backends.{name}] to a directory holding its login files (looked for {looked})",
        sign_in(kind)
    );
    match config.auth {
        AuthMode::None => Credential::None,
        AuthMode::Key => key().unwrap_or_else(|| Credential::Missing {
            reason: format!(
                "`{name}` has auth = \"key\" but {no_key}: set api_key_env to a variable holding the key"
            ),
        }),
        AuthMode::Login => login().unwrap_or_else(|| Credential::Missing {
            reason: format!("`{name}` has auth = \"login\" but no login: {login_fix}"),
        }),
        AuthMode::Auto => key().or_else(login).unwrap_or_else(|| Credential::Missing {
            reason: format!(
                "no credential for `{name}`: {no_key} and no login; set api_key_env, or {login_fix}"
            ),
        }),
    }
}

/// A login file copied into a run's home.
#[derive(Debug)]
pub(crate) struct Copied {
    source: PathBuf,
    run: PathBuf,
    original: Vec<u8>,
}

/// Copies the login files into `home` (owner-only), returning what to write back afterwards.
pub(crate) fn install(files: &[LoginFile], home: &Path) -> std::io::Result<Vec<Copied>> {
    let mut copied = Vec::new();
    for file in files {
        let original = match std::fs::read(&file.source) {
            Ok(bytes) => bytes,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound && !file.required => continue,
            Err(err) => {
                return Err(std::io::Error::new(
                    err.kind(),
                    format!("reading {}: {err}", file.source.display()),
                ));
            }
        };
        register_tokens(&original);
        let run = home.join(file.run_path);
        if let Some(parent) = run.parent() {
            std::fs::create_dir_all(parent)?;
        }
        write_private(&run, &original)?;
        copied.push(Copied {
            source: file.source.clone(),
            run,
            original,
        });
    }
    Ok(copied)
}

/// Masks the tokens and keys a login file holds wherever troupe writes (a CLI may echo one in
/// an error): every string under a key naming a token or a key.
fn register_tokens(bytes: &[u8]) {
    fn walk(value: &serde_json::Value, secret: bool) {
        match value {
            serde_json::Value::String(text) if secret => troupe_telemetry::register_secret(text),
            serde_json::Value::Object(map) => {
                for (key, value) in map {
                    let key = key.to_ascii_lowercase();
                    walk(
                        value,
                        key.contains("token") || key == "key" || key.ends_with("_key"),
                    );
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|v| walk(v, secret)),
            _ => {}
        }
    }
    if let Ok(value) = serde_json::from_slice::<serde_json::Value>(bytes) {
        walk(&value, false);
    }
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename, so a
/// reader sees the old file or the new one, never half of one.
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
    tmp.as_file()
        .set_permissions(std::fs::Permissions::from_mode(0o600))?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|err| err.error)?;
    Ok(())
}

/// After a run: writes each refreshed file back to its source (when the source still holds
/// what was copied), then removes the copies. Returns what could not be written back.
pub(crate) fn write_back(copied: Vec<Copied>) -> Vec<String> {
    let mut problems = Vec::new();
    for file in copied {
        match std::fs::read(&file.run) {
            Ok(now) if now != file.original && !now.is_empty() => {
                match std::fs::read(&file.source) {
                    Ok(source) if source == file.original => {
                        if let Err(err) = write_private(&file.source, &now) {
                            problems.push(format!(
                                "cannot write the refreshed login back to {}: {err}",
                                file.source.display()
                            ));
                        }
                    }
                    // Another run refreshed it first: its token is as new as ours.
                    _ => {}
                }
            }
            _ => {}
        }
        let _ = std::fs::remove_file(&file.run);
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_prefers_a_key_then_a_login_and_says_how_to_fix_neither() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut config = BackendConfig {
            login_dir: Some(dir.path().to_path_buf()),
            ..BackendConfig::default()
        };
        let missing = resolve(CliKind::Codex, &config);
        let Credential::Missing { reason } = &missing else {
            panic!("{missing:?}")
        };
        assert!(reason.contains("`codex login`"), "{reason}");
        assert!(reason.contains(&dir.path().join("auth.json").display().to_string()));

        std::fs::write(dir.path().join("auth.json"), "{}").expect("write");
        assert!(resolve(CliKind::Codex, &config).is_login());
        assert!(
            resolve(CliKind::Codex, &config)
                .describe()
                .ends_with("auth.json")
        );

        config.api_key = Some("k".into());
        assert_eq!(
            resolve(CliKind::Codex, &config).describe(),
            "key: api_key in [backends.codex]"
        );
        config.auth = AuthMode::Login;
        assert!(resolve(CliKind::Codex, &config).is_login());
        config.auth = AuthMode::None;
        assert_eq!(resolve(CliKind::Codex, &config), Credential::None);
        config.auth = AuthMode::Key;
        config.api_key = None;
        config.api_key_env = Some("TROUPE_TEST_NO_SUCH_VAR_XYZ".into());
        let Credential::Missing { reason } = resolve(CliKind::Codex, &config) else {
            panic!("no key")
        };
        assert!(
            reason.contains("$TROUPE_TEST_NO_SUCH_VAR_XYZ (api_key_env) is not set"),
            "{reason}"
        );
        config.env.insert("OPENAI_API_KEY".into(), "k".into());
        assert_eq!(
            resolve(CliKind::Codex, &config).describe(),
            "key: OPENAI_API_KEY in [backends.codex.env]"
        );
    }

    #[test]
    fn a_refreshed_login_is_written_back_unless_the_source_moved_on() {
        let user = tempfile::tempdir().expect("tempdir");
        let home = tempfile::tempdir().expect("tempdir");
        let files = login_files(CliKind::Gemini, Some(user.path()));
        std::fs::write(&files[0].source, "old").expect("write");
        // google_accounts.json is optional: absent, it is skipped.
        let copied = install(&files, home.path()).expect("install");
        assert_eq!(copied.len(), 1);
        let run = home.path().join("gemini/.gemini/oauth_creds.json");
        assert_eq!(std::fs::read_to_string(&run).expect("copied"), "old");
        std::fs::write(&run, "refreshed").expect("refresh");
        assert!(write_back(copied).is_empty());
        assert_eq!(
            std::fs::read_to_string(&files[0].source).expect("src"),
            "refreshed"
        );
        assert!(!run.exists(), "the copy is removed after the run");

        // The token is now masked wherever troupe writes.
        std::fs::write(
            &files[0].source,
            r#"{"access_token":"ya29.secret-login-token-1"}"#,
        )
        .expect("write");
        let copied = install(&files, home.path()).expect("install");
        assert_eq!(
            troupe_telemetry::redact("echo ya29.secret-login-token-1"),
            "echo [redacted]"
        );
        assert!(write_back(copied).is_empty());

        // Another run wrote a newer token meanwhile: ours does not overwrite it.
        let copied = install(&files, home.path()).expect("install");
        std::fs::write(&files[0].source, "newer elsewhere").expect("write");
        std::fs::write(&run, "ours").expect("refresh");
        assert!(write_back(copied).is_empty());
        assert_eq!(
            std::fs::read_to_string(&files[0].source).expect("src"),
            "newer elsewhere"
        );
    }
}
