//! How a process authenticates to git remotes: an operator's file of rules by URL prefix, never
//! anything from a plan.
//!
//! ```toml
//! [[remote]]
//! prefix = "https://git.example.com/team/"
//! token_file = "/run/secrets/git-token"   # or token_env = "GIT_TOKEN"
//! username = "x-access-token"             # HTTP basic user (default); scheme = "bearer" sends
//!                                         # `Authorization: Bearer <token>` instead
//!
//! [[remote]]
//! prefix = "ssh://git@git.example.com/"
//! ssh_key_file = "/run/secrets/deploy-key"
//! ```
//!
//! The first rule whose prefix starts the remote's URL applies. Secrets are read when a git
//! command needs them (a rotated file takes effect at the next fetch or push) and reach git
//! only through its environment (`GIT_CONFIG_*` for an HTTP header, `GIT_SSH_COMMAND` for a
//! key file), so they appear in no argv, no URL and no `.git/config`.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::{Error, Remote};

/// Credentials by URL prefix.
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    rules: Vec<Rule>,
}

/// One rule of the file, as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Rule {
    prefix: String,
    #[serde(default)]
    token_file: Option<PathBuf>,
    #[serde(default)]
    token_env: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    scheme: Option<String>,
    #[serde(default)]
    ssh_key_file: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    remote: Vec<Rule>,
}

impl Credentials {
    /// No credentials: public remotes and local paths only.
    pub fn none() -> Self {
        Self::default()
    }

    /// Reads the rules of `path` (TOML, see the module docs), checking every rule.
    pub fn load(path: &Path) -> Result<Self, Error> {
        let invalid = |why: String| Error::Credentials {
            path: path.to_path_buf(),
            why,
        };
        let text = std::fs::read_to_string(path).map_err(|err| invalid(err.to_string()))?;
        let credentials = Self::parse(&text).map_err(invalid)?;
        // Tokens reach git's environment only; anywhere else troupe writes, they are masked.
        for secret in credentials.secrets() {
            troupe_telemetry::register_secret(secret);
        }
        Ok(credentials)
    }

    fn parse(text: &str) -> Result<Self, String> {
        let file: File = toml::from_str(text).map_err(|err| err.to_string())?;
        for (n, rule) in file.remote.iter().enumerate() {
            let at = format!("remote #{} ({})", n + 1, rule.prefix);
            if rule.prefix.is_empty() {
                return Err(format!("{at}: empty prefix"));
            }
            let tokens =
                usize::from(rule.token_file.is_some()) + usize::from(rule.token_env.is_some());
            match (tokens, &rule.ssh_key_file) {
                (1, None) | (0, Some(_)) => {}
                (0, None) => {
                    return Err(format!("{at}: give token_file, token_env or ssh_key_file"));
                }
                _ => {
                    return Err(format!(
                        "{at}: give one of token_file, token_env and ssh_key_file"
                    ));
                }
            }
            if let Some(key) = &rule.ssh_key_file
                && key
                    .to_str()
                    .is_none_or(|k| k.contains('\'') || !key.is_absolute())
            {
                return Err(format!(
                    "{at}: ssh_key_file must be an absolute path without quotes"
                ));
            }
            if rule
                .scheme
                .as_deref()
                .is_some_and(|s| s != "basic" && s != "bearer")
            {
                return Err(format!("{at}: scheme must be \"basic\" or \"bearer\""));
            }
        }
        Ok(Self { rules: file.remote })
    }

    /// Whether any rule is configured.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    fn rule_for(&self, remote: &Remote) -> Option<&Rule> {
        self.rules
            .iter()
            .find(|rule| remote.as_str().starts_with(&rule.prefix))
    }

    /// The environment a git command talking to `remote` needs (empty without a rule).
    pub(crate) fn env_for(&self, remote: &Remote) -> Result<Vec<(String, String)>, Error> {
        let Some(rule) = self.rule_for(remote) else {
            return Ok(Vec::new());
        };
        if let Some(key) = &rule.ssh_key_file {
            let key = key.display();
            return Ok(vec![(
                "GIT_SSH_COMMAND".to_owned(),
                format!(
                    "ssh -i '{key}' -o IdentitiesOnly=yes -o BatchMode=yes -o StrictHostKeyChecking=accept-new"
                ),
            )]);
        }
        let token = self.token(rule)?;
        let header = if rule.scheme.as_deref() == Some("bearer") {
            format!("Authorization: Bearer {token}")
        } else {
            let user = rule.username.as_deref().unwrap_or("x-access-token");
            format!(
                "Authorization: Basic {}",
                base64(&format!("{user}:{token}"))
            )
        };
        Ok(vec![
            ("GIT_CONFIG_COUNT".to_owned(), "1".to_owned()),
            ("GIT_CONFIG_KEY_0".to_owned(), "http.extraHeader".to_owned()),
            ("GIT_CONFIG_VALUE_0".to_owned(), header),
        ])
    }

    fn token(&self, rule: &Rule) -> Result<String, Error> {
        let missing = |why: String| Error::Credentials {
            path: PathBuf::from(&rule.prefix),
            why,
        };
        let token = match (&rule.token_file, &rule.token_env) {
            (Some(file), _) => std::fs::read_to_string(file)
                .map_err(|err| missing(format!("token file {}: {err}", file.display())))?,
            (None, Some(var)) => std::env::var(var)
                .map_err(|_| missing(format!("environment variable {var} is not set")))?,
            (None, None) => return Err(missing("no token configured".to_owned())),
        };
        let token = token.trim().to_owned();
        if token.is_empty() || token.chars().any(char::is_control) {
            return Err(missing(
                "the token is empty or has control characters".to_owned(),
            ));
        }
        Ok(token)
    }

    /// The secret values this configuration can send (tokens now in their files or variables),
    /// for redacting logs.
    pub fn secrets(&self) -> Vec<String> {
        self.rules
            .iter()
            .filter(|rule| rule.ssh_key_file.is_none())
            .filter_map(|rule| self.token(rule).ok())
            .collect()
    }
}

/// Standard base64 with padding (RFC 4648), for an HTTP basic header.
fn base64(text: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_pick_by_prefix_and_keep_tokens_out_of_argv() {
        let dir = tempfile::tempdir().expect("tempdir");
        let token = dir.path().join("token");
        std::fs::write(&token, "s3cret\n").expect("write");
        let creds = Credentials::parse(&format!(
            "[[remote]]\nprefix = \"https://git.example.com/\"\ntoken_file = \"{}\"\n\n[[remote]]\nprefix = \"ssh://git@h/\"\nssh_key_file = \"/keys/id\"\n",
            token.display()
        ))
        .expect("valid");
        let https = Remote::parse("https://git.example.com/a.git").expect("url");
        let env = creds.env_for(&https).expect("env");
        assert_eq!(
            env[2].1,
            format!("Authorization: Basic {}", base64("x-access-token:s3cret"))
        );
        let ssh = Remote::parse("ssh://git@h/a.git").expect("url");
        assert!(
            creds.env_for(&ssh).expect("env")[0]
                .1
                .contains("-i '/keys/id'")
        );
        let other = Remote::parse("https://elsewhere/a.git").expect("url");
        assert!(creds.env_for(&other).expect("env").is_empty());
        assert_eq!(creds.secrets(), ["s3cret"]);
    }

    #[test]
    fn bad_rules_are_refused() {
        for bad in [
            "[[remote]]\nprefix = \"https://h/\"\n",
            "[[remote]]\nprefix = \"https://h/\"\ntoken_env = \"A\"\nssh_key_file = \"/k\"\n",
            "[[remote]]\nprefix = \"ssh://h/\"\nssh_key_file = \"relative\"\n",
            "[[remote]]\nprefix = \"https://h/\"\ntoken_env = \"A\"\nscheme = \"digest\"\n",
            "[[remote]]\nprefix = \"https://h/\"\ntoken_env = \"A\"\npassword = \"x\"\n",
        ] {
            assert!(Credentials::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn base64_matches_rfc_4648() {
        for (plain, encoded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(plain), encoded);
        }
    }
}
