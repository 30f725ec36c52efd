//! A worker's mirrors: one bare repository per remote, under the worker's own data directory.
//!
//! Worktrees come from the mirror, commits are made in it, and results leave it only by push,
//! so a worker never needs another process's disk: on one machine a `path` repository is just
//! a local remote. A mirror fetches incrementally, only what a task needs (its session's
//! branches and fences, or one revision), and its fetches take turns.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tracing::debug;

use crate::git::{Git, failure};
use crate::{Credentials, Error, Oid, Remote, Repo, lock_for, parse_oid};

/// How long a fetch or push may take: a first fetch of a large repository.
const TRANSFER_TIMEOUT: Duration = Duration::from_secs(600);

/// The mirrors of one worker, under `dir`.
#[derive(Debug, Clone)]
pub struct Mirrors {
    dir: PathBuf,
    credentials: Arc<Credentials>,
}

impl Mirrors {
    /// Mirrors kept under `dir` (created on first use), for public remotes and local paths.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            credentials: Arc::new(Credentials::none()),
        }
    }

    /// Authenticates to remotes with `credentials`.
    pub fn with_credentials(mut self, credentials: Arc<Credentials>) -> Self {
        self.credentials = credentials;
        self
    }

    /// The directory holding the mirrors.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Forgets the worktrees every mirror recorded whose directories are gone (after a crash
    /// removed them, or the start-up clean-up did).
    pub async fn prune_worktrees(&self) -> Result<(), Error> {
        let Ok(mut entries) = tokio::fs::read_dir(&self.dir).await else {
            return Ok(());
        };
        while let Ok(Some(entry)) = entries.next_entry().await {
            let path = entry.path();
            if path.join("HEAD").is_file() {
                Git::new(&path).ok(&["worktree", "prune"]).await?;
            }
        }
        Ok(())
    }

    /// The mirror of `remote`, made (empty) when this worker has none yet.
    pub async fn open(&self, remote: &Remote) -> Result<Mirror, Error> {
        // A local remote that is no repository at all is a plain bad argument, said as such.
        if let Some(local) = remote.local_path() {
            let is_repo = local.join(".git").exists() || local.join("HEAD").is_file();
            if !is_repo {
                return Err(Error::NotARepo {
                    path: local.to_path_buf(),
                });
            }
        }
        let path = self.dir.join(remote.mirror_name());
        let lock = lock_for("mirror-init", &path);
        let _turn = lock.lock().await;
        if !path.join("HEAD").is_file() {
            tokio::fs::create_dir_all(&self.dir)
                .await
                .map_err(|source| Error::Io {
                    path: self.dir.clone(),
                    source,
                })?;
            // Made aside and renamed, so a crash never leaves half a mirror at the path.
            let partial = self.dir.join(format!(
                ".init-{}-{}",
                std::process::id(),
                remote.mirror_name()
            ));
            if partial.exists() {
                let _ = tokio::fs::remove_dir_all(&partial).await;
            }
            Git::new(&self.dir)
                .ok(&["init", "-q", "--bare", crate::utf8(&partial)?])
                .await?;
            tokio::fs::rename(&partial, &path)
                .await
                .map_err(|source| Error::Io {
                    path: path.clone(),
                    source,
                })?;
            debug!(remote = %remote, mirror = %path.display(), "made a mirror");
        }
        Ok(Mirror {
            remote: remote.clone(),
            repo: Repo::bare(path),
            credentials: Arc::clone(&self.credentials),
        })
    }
}

/// A bare mirror of one remote.
#[derive(Debug, Clone)]
pub struct Mirror {
    remote: Remote,
    repo: Repo,
    credentials: Arc<Credentials>,
}

/// The refspecs that carry a session: its branch, its task branches and its tasks' fences.
/// A glob may also match a session whose id extends this one; that only fetches a little more.
fn session_refspecs(session: &str) -> [String; 3] {
    let fences = crate::fence::FENCE_PREFIX;
    [
        format!("+refs/heads/troupe/{session}*:refs/heads/troupe/{session}*"),
        format!("+refs/heads/troupe-task/{session}/*:refs/heads/troupe-task/{session}/*"),
        format!("+{fences}{session}/*:{fences}{session}/*"),
    ]
}

impl Mirror {
    /// The remote this mirrors.
    pub fn remote(&self) -> &Remote {
        &self.remote
    }

    /// The bare repository (for reads: resolve, diffs, file contents, worktrees).
    pub fn repo(&self) -> &Repo {
        &self.repo
    }

    pub(crate) fn git(&self) -> &Git {
        self.repo.git()
    }

    /// Runs a git command that talks to the remote, with the remote's credentials.
    async fn transfer(
        &self,
        args: &[&str],
        timeout: Duration,
    ) -> Result<troupe_process::Output, Error> {
        let env = self.credentials.env_for(&self.remote)?;
        self.git().run_with(args, &env, timeout).await
    }

    /// Fetches `refspecs` from the remote. Fetches of one mirror take turns with each other
    /// and with its worktree bookkeeping: a fetch's connectivity check reads every worktree's
    /// records, and one half written by a concurrent `worktree add` fails it.
    pub async fn fetch(&self, refspecs: &[String]) -> Result<(), Error> {
        let lock = crate::worktree_lock(self.repo.path());
        let _turn = lock.lock().await;
        let mut args = vec![
            "fetch",
            "--quiet",
            "--prune",
            "--no-tags",
            "--no-write-fetch-head",
            "--end-of-options",
            self.remote.as_str(),
        ];
        args.extend(refspecs.iter().map(String::as_str));
        let output = self.transfer(&args, TRANSFER_TIMEOUT).await?;
        if output.success() {
            return Ok(());
        }
        Err(Error::Unreachable {
            remote: self.remote.to_string(),
            detail: failure(&args, &output).to_string(),
        })
    }

    /// Brings the session's branch, task branches and fences up to date.
    pub async fn fetch_session(&self, session: &str) -> Result<(), Error> {
        self.fetch(&session_refspecs(session)).await
    }

    /// Brings the session's refs and `branch` (which may lie outside the session's names, or
    /// not exist yet) up to date.
    pub async fn fetch_session_branch(&self, session: &str, branch: &str) -> Result<(), Error> {
        let full = self.repo.check_branch_name(branch).await?;
        let mut refspecs = session_refspecs(session).to_vec();
        refspecs.push(format!("+{full}*:{full}*"));
        self.fetch(&refspecs).await
    }

    /// Deletes `full_ref` on the remote if it is still at `expected`; returns whether it did.
    pub async fn delete_ref(&self, full_ref: &str, expected: &Oid) -> Result<bool, Error> {
        self.push(
            &[format!(":{full_ref}")],
            &[format!("--force-with-lease={full_ref}:{expected}")],
            Duration::from_secs(120),
        )
        .await
    }

    /// Fetches one revision (a branch, tag or commit id) and returns the commit it names.
    pub async fn fetch_rev(&self, rev: &str) -> Result<Oid, Error> {
        if rev.is_empty() || rev.starts_with('-') {
            return Err(Error::UnknownRevision {
                rev: rev.to_owned(),
            });
        }
        if let Some(oid) = Oid::parse(rev)
            && self.has_commit(&oid).await?
        {
            return Ok(oid);
        }
        let lock = crate::worktree_lock(self.repo.path());
        let _turn = lock.lock().await;
        let args = [
            "fetch",
            "--quiet",
            "--no-tags",
            "--end-of-options",
            self.remote.as_str(),
            rev,
        ];
        let output = self.transfer(&args, TRANSFER_TIMEOUT).await?;
        if !output.success() {
            let stderr = output.stderr_text();
            if stderr.contains("couldn't find remote ref") || stderr.contains("not our ref") {
                return Err(Error::UnknownRevision {
                    rev: rev.to_owned(),
                });
            }
            return Err(Error::Unreachable {
                remote: self.remote.to_string(),
                detail: failure(&args, &output).to_string(),
            });
        }
        let head = self
            .git()
            .ok(&["rev-parse", "--verify", "FETCH_HEAD^{commit}"])
            .await?;
        parse_oid(&head, "git rev-parse FETCH_HEAD")
    }

    /// Whether the mirror holds commit `oid`.
    pub async fn has_commit(&self, oid: &Oid) -> Result<bool, Error> {
        let spec = format!("{oid}^{{commit}}");
        Ok(self.git().run(&["cat-file", "-e", &spec]).await?.success())
    }

    /// Makes sure commit `oid` is here: as is, else from the session's refs, else by id.
    pub async fn ensure_commit(&self, oid: &Oid, session: Option<&str>) -> Result<(), Error> {
        if self.has_commit(oid).await? {
            return Ok(());
        }
        if let Some(session) = session {
            self.fetch_session(session).await?;
            if self.has_commit(oid).await? {
                return Ok(());
            }
        }
        self.fetch_rev(oid.as_str()).await.map(drop)
    }

    /// Creates `branch` on the remote at `commit`, refusing when it already exists there.
    pub async fn push_new_branch(&self, branch: &str, commit: &Oid) -> Result<(), Error> {
        let full = self.repo.check_branch_name(branch).await?;
        let refspec = format!("{commit}:{full}");
        let lease = format!("--force-with-lease={full}:");
        let pushed = self
            .push(&[refspec], &[lease], Duration::from_secs(300))
            .await?;
        if pushed {
            Ok(())
        } else {
            Err(Error::BranchExists {
                name: branch.to_owned(),
                current: self
                    .remote_head(&full)
                    .await?
                    .unwrap_or_else(|| commit.clone()),
            })
        }
    }

    /// Sets `full_ref` on the remote to `commit`, whatever it was (a ref of troupe's own, such
    /// as the one sharing an attempt's commit with the validator).
    pub async fn push_ref(&self, full_ref: &str, commit: &Oid) -> Result<(), Error> {
        let refspec = format!("+{commit}:{full_ref}");
        if self.push(&[refspec], &[], Duration::from_secs(300)).await? {
            Ok(())
        } else {
            Err(Error::PushRejected {
                remote: self.remote.to_string(),
                detail: format!("could not set {full_ref}"),
            })
        }
    }

    /// Where `full_ref` points on the remote now, if it exists.
    pub async fn remote_head(&self, full_ref: &str) -> Result<Option<Oid>, Error> {
        let args = [
            "ls-remote",
            "--end-of-options",
            self.remote.as_str(),
            full_ref,
        ];
        let output = self.git().run(&args).await?;
        if !output.success() {
            return Err(Error::Unreachable {
                remote: self.remote.to_string(),
                detail: failure(&args, &output).to_string(),
            });
        }
        let text = output.stdout_text();
        Ok(text
            .lines()
            .find_map(|line| line.split_once('\t').filter(|(_, name)| *name == full_ref))
            .and_then(|(oid, _)| Oid::parse(oid)))
    }

    /// Pushes `refspecs` atomically with `leases` (`--force-with-lease=…`) within `timeout`.
    /// Returns false when the remote refused because a ref was not where a lease expected
    /// (a lost race), true when everything landed; any other refusal is an error.
    pub(crate) async fn push(
        &self,
        refspecs: &[String],
        leases: &[String],
        timeout: Duration,
    ) -> Result<bool, Error> {
        let mut args = vec!["push", "--porcelain", "--atomic", "--no-verify"];
        args.extend(leases.iter().map(String::as_str));
        args.push("--end-of-options");
        args.push(self.remote.as_str());
        args.extend(refspecs.iter().map(String::as_str));
        let output = match self.transfer(&args, timeout).await {
            Ok(output) => output,
            // A push cut off by its deadline may or may not have landed; the caller reads the
            // remote to find out, as after a lost race.
            Err(Error::Git { code: None, .. }) => return Ok(false),
            Err(err) => return Err(err),
        };
        if output.success() {
            return Ok(true);
        }
        let text = format!("{}\n{}", output.stdout_text(), output.stderr_text());
        const RACES: &[&str] = &[
            "stale info",
            "fetch first",
            "non-fast-forward",
            "cannot lock ref",
            "failed to update ref",
            "incorrect old value",
            "atomic push failed",
            "atomic transaction failed",
            "reference already exists",
        ];
        let refused: Vec<&str> = text.lines().filter(|line| line.starts_with('!')).collect();
        if !refused.is_empty()
            && refused
                .iter()
                .all(|line| RACES.iter().any(|r| line.contains(r)))
        {
            debug!(refused = ?refused, "push lost a race");
            return Ok(false);
        }
        if refused.is_empty() {
            return Err(Error::Unreachable {
                remote: self.remote.to_string(),
                detail: failure(&args, &output).to_string(),
            });
        }
        Err(Error::PushRejected {
            remote: self.remote.to_string(),
            detail: troupe_process::tail(&refused.join("\n"), 10, 2000),
        })
    }
}
