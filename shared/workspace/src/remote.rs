//! Where a repository lives, as git addresses it.

use std::fmt;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::git::{Git, failure};
use crate::{Credentials, Error, Oid};

/// A repository's address: an absolute local path (a remote on this machine, as `git push
/// /path` treats it) or a `file://`, `git://`, `ssh://`, `http(s)://` URL. Never carries a
/// password: credentials belong to the worker, not to the address.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Remote(String);

/// URL schemes git can fetch from and push to.
const SCHEMES: &[&str] = &["file://", "git://", "ssh://", "http://", "https://"];

impl Remote {
    /// Parses an absolute path or a URL; refuses relative paths, option-like text and
    /// passwords in URLs.
    pub fn parse(text: &str) -> Result<Self, Error> {
        let invalid = |why: &str| Error::InvalidRemote {
            remote: redact(text),
            why: why.to_owned(),
        };
        let text = text.trim();
        if text.is_empty() {
            return Err(invalid("empty"));
        }
        if text.starts_with('-') || text.chars().any(char::is_control) {
            return Err(invalid("not a path or URL"));
        }
        if let Some(scheme) = SCHEMES.iter().find(|scheme| text.starts_with(**scheme)) {
            let rest = &text[scheme.len()..];
            let authority = rest.split('/').next().unwrap_or_default();
            if authority.contains('@')
                && authority.split('@').next().is_some_and(|u| u.contains(':'))
            {
                return Err(invalid(
                    "a password in the URL: credentials come from the worker's configuration",
                ));
            }
            if *scheme != "file://" && authority.is_empty() {
                return Err(invalid("no host"));
            }
            return Ok(Self(text.to_owned()));
        }
        if text.contains("://") {
            return Err(invalid("unsupported scheme (file, git, ssh, http, https)"));
        }
        if Path::new(text).is_absolute() {
            return Ok(Self(text.to_owned()));
        }
        Err(invalid("a relative path (give an absolute path or a URL)"))
    }

    /// A local path as a remote.
    pub fn from_path(path: &Path) -> Result<Self, Error> {
        Self::parse(crate::utf8(path)?)
    }

    /// The address as git takes it.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The local directory, when the remote is a path or a `file://` URL.
    pub fn local_path(&self) -> Option<&Path> {
        let path = self.0.strip_prefix("file://").unwrap_or(&self.0);
        Path::new(path).is_absolute().then(|| Path::new(path))
    }

    /// The repository's own name: the last part of its path, without `.git`.
    pub fn name(&self) -> &str {
        self.0
            .trim_end_matches('/')
            .rsplit(['/', ':'])
            .next()
            .unwrap_or_default()
            .trim_end_matches(".git")
    }

    /// A directory name for this remote's mirror: readable and stable across runs.
    pub(crate) fn mirror_name(&self) -> String {
        let readable: String = self
            .name()
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .take(40)
            .collect();
        let digest = Sha256::digest(self.0.as_bytes());
        let hash: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        format!("{readable}-{hash}.git")
    }
}

impl Remote {
    /// Resolves `rev` (a branch, a tag, a full ref, or the remote's `HEAD` when `None`) to a
    /// commit without a clone (`git ls-remote`). A full commit id is taken as given for a URL
    /// (remotes advertise refs, not commits: the workers that fetch it will say if it is
    /// missing) and checked in a local remote.
    pub async fn resolve(
        &self,
        credentials: &Credentials,
        rev: Option<&str>,
    ) -> Result<Oid, Error> {
        let rev = rev.unwrap_or("HEAD");
        if rev.is_empty() || rev.starts_with('-') {
            return Err(Error::UnknownRevision {
                rev: rev.to_owned(),
            });
        }
        if let Some(oid) = Oid::parse(rev) {
            if let Some(path) = self.local_path() {
                let spec = format!("{oid}^{{commit}}");
                let found = Git::new(path).run(&["cat-file", "-e", &spec]).await?;
                if !found.success() {
                    return Err(Error::UnknownRevision {
                        rev: rev.to_owned(),
                    });
                }
            }
            return Ok(oid);
        }
        let env = credentials.env_for(self)?;
        // Without a revision, every ref: a bare remote whose HEAD names a branch it lacks
        // (made with another default branch) still starts at its `main` or `master`.
        let pattern = if rev == "HEAD" { None } else { Some(rev) };
        let mut args = vec!["ls-remote", "--end-of-options", self.as_str()];
        args.extend(pattern);
        let output = Git::new("/")
            .run_with(&args, &env, std::time::Duration::from_secs(120))
            .await?;
        if !output.success() {
            return Err(Error::Unreachable {
                remote: self.to_string(),
                detail: failure(&args, &output).to_string(),
            });
        }
        let text = output.stdout_text();
        let refs: Vec<(&str, &str)> = text
            .lines()
            .filter_map(|line| line.split_once('\t'))
            .collect();
        let wanted = if pattern.is_none() {
            vec![
                "HEAD".to_owned(),
                "refs/heads/main".to_owned(),
                "refs/heads/master".to_owned(),
            ]
        } else {
            vec![
                rev.to_owned(),
                format!("refs/heads/{rev}"),
                format!("refs/tags/{rev}^{{}}"),
                format!("refs/tags/{rev}"),
            ]
        };
        wanted
            .iter()
            .find_map(|name| refs.iter().find(|(_, r)| r == name))
            .and_then(|(oid, _)| Oid::parse(oid))
            .ok_or_else(|| Error::UnknownRevision {
                rev: rev.to_owned(),
            })
    }
}

impl fmt::Display for Remote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// `text` with any userinfo of a URL replaced, for error messages.
fn redact(text: &str) -> String {
    match text.split_once("://") {
        Some((scheme, rest)) => match rest.split_once('@') {
            Some((userinfo, host)) if !userinfo.contains('/') => format!("{scheme}://***@{host}"),
            _ => text.to_owned(),
        },
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_urls_parse_and_bad_ones_are_refused() {
        for good in [
            "/srv/repos/app",
            "file:///srv/repos/app.git",
            "git://127.0.0.1:9418/app.git",
            "ssh://git@example.com/team/app.git",
            "https://example.com/team/app.git",
        ] {
            assert_eq!(Remote::parse(good).expect(good).as_str(), good);
        }
        for bad in [
            "",
            "relative/path",
            "--upload-pack=evil",
            "ftp://example.com/app",
            "https://user:secret@example.com/app.git",
            "https:///app.git",
        ] {
            let err = Remote::parse(bad).expect_err(bad).to_string();
            assert!(!err.contains("secret"), "{err}");
        }
    }

    #[test]
    fn mirror_names_are_readable_and_distinct() {
        let a = Remote::parse("/srv/a/app").expect("path");
        let b = Remote::parse("/srv/b/app").expect("path");
        assert!(a.mirror_name().starts_with("app-"));
        assert_ne!(a.mirror_name(), b.mirror_name());
        assert_eq!(
            Remote::parse("https://example.com/t/app.git")
                .expect("url")
                .local_path(),
            None
        );
        assert_eq!(
            Remote::parse("file:///srv/app.git")
                .expect("url")
                .local_path(),
            Some(Path::new("/srv/app.git"))
        );
    }
}
