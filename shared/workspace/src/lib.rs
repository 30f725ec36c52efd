//! Git plumbing for troupe: remotes and the worker's mirrors of them, session and task
//! branches, per-task worktrees, commits, and exactly-once integration of a task's commit into
//! a session branch on the remote ([`fence`]).
//!
//! Everything goes through the `git` binary (as an argv vector, via troupe-process) in one
//! module, with hooks disabled, no prompts, a fixed troupe identity and an allow-listed
//! environment. [`Repo::integrate`] never touches a checkout: it fast-forwards or builds a
//! merge with `git merge-tree --write-tree` + `git commit-tree`, then moves the branch with a
//! compare-and-swap `git update-ref`, retrying when another integration won the race.

mod credentials;
pub mod fence;
mod git;
mod mirror;
mod remote;
mod template;

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use tracing::{debug, info};

pub use crate::credentials::Credentials;
pub use crate::fence::{Attempt, Claim, ConfirmWith, Held, Landed, Lease, Publication, Unleased};
use crate::git::{Git, failure};
pub use crate::mirror::{Mirror, Mirrors};
pub use crate::remote::Remote;

/// How often [`Repo::integrate`] retries after losing a compare-and-swap race.
const INTEGRATE_ATTEMPTS: usize = 32;

/// How often a `git worktree add` that raced with another process is tried.
const WORKTREE_ATTEMPTS: usize = 5;

/// One lock per purpose and repository in this process: worktree bookkeeping, a mirror's
/// fetches, a mirror's creation.
pub(crate) fn lock_for(purpose: &'static str, root: &Path) -> Arc<tokio::sync::Mutex<()>> {
    type Locks = Mutex<HashMap<(&'static str, PathBuf), Arc<tokio::sync::Mutex<()>>>>;
    static LOCKS: OnceLock<Locks> = OnceLock::new();
    let locks = LOCKS.get_or_init(Mutex::default);
    let mut locks = locks
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    Arc::clone(locks.entry((purpose, root.to_path_buf())).or_default())
}

fn worktree_lock(root: &Path) -> Arc<tokio::sync::Mutex<()>> {
    lock_for("worktree", root)
}

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The path is not the top directory of a git work tree.
    #[error("{} is not the top of a git work tree", path.display())]
    NotARepo {
        /// The path as given.
        path: PathBuf,
    },
    /// A revision that does not name a commit.
    #[error("unknown revision `{rev}`")]
    UnknownRevision {
        /// The revision as given.
        rev: String,
    },
    /// A branch name git refuses.
    #[error("invalid branch name `{name}`")]
    InvalidBranchName {
        /// The name as given.
        name: String,
    },
    /// The branch already exists and points at another commit.
    #[error("branch `{name}` already exists at {current}")]
    BranchExists {
        /// Branch name.
        name: String,
        /// Where it points.
        current: Oid,
    },
    /// The branch does not exist.
    #[error("branch `{name}` does not exist")]
    BranchMissing {
        /// Branch name.
        name: String,
    },
    /// A three-way merge conflicted on these paths.
    #[error("merge conflict in {}", paths.join(", "))]
    Conflict {
        /// Conflicting paths, relative to the repository root.
        paths: Vec<String>,
    },
    /// Other integrations kept moving the branch while this one retried.
    #[error("gave up integrating into `{branch}` after {attempts} lost races")]
    Contended {
        /// Target branch.
        branch: String,
        /// Attempts made.
        attempts: usize,
    },
    /// A path that is not valid UTF-8 (git arguments are passed as text).
    #[error("path {} is not valid utf-8", path.display())]
    NonUtf8Path {
        /// The path.
        path: PathBuf,
    },
    /// A git command failed.
    #[error("`{command}` failed (exit {code:?}): {stderr}")]
    Git {
        /// The command, for the log.
        command: String,
        /// Its exit code.
        code: Option<i32>,
        /// The tail of its stderr.
        stderr: String,
    },
    /// Running git failed (not installed, timeout).
    #[error(transparent)]
    Process(#[from] troupe_process::Error),
    /// The credentials file (or one of its rules) cannot be used.
    #[error("git credentials {}: {why}", path.display())]
    Credentials {
        /// The file, or the rule's prefix.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// A repository address that is neither an absolute path nor a supported URL.
    #[error("invalid repository `{remote}`: {why}")]
    InvalidRemote {
        /// The address, with any credentials removed.
        remote: String,
        /// What is wrong with it.
        why: String,
    },
    /// The remote could not be read or written (unreachable, no such repository, refused
    /// credentials).
    #[error("repository {remote} is unreachable: {detail}")]
    Unreachable {
        /// The remote.
        remote: String,
        /// What git said.
        detail: String,
    },
    /// The remote refused a push for a reason other than a lost race (a hook, a protected
    /// branch, permissions).
    #[error("{remote} refused the push: {detail}")]
    PushRejected {
        /// The remote.
        remote: String,
        /// The refusal as git reported it.
        detail: String,
    },
    /// A newer attempt of the task holds its fence: this attempt's work must not land.
    #[error("attempt of {task} superseded: fencing token {ours} is behind the remote's {theirs}")]
    Superseded {
        /// Task id.
        task: String,
        /// This attempt's token.
        ours: u64,
        /// The token on the remote's fence.
        theirs: u64,
    },
    /// The lease ran out before the commit could be published.
    #[error("the lease of {task} ran out before its commit was published")]
    LeaseExpired {
        /// Task id.
        task: String,
    },
    /// File system error (template copy, worktree clean-up).
    #[error("i/o error on {}: {source}", path.display())]
    Io {
        /// The path being worked on.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

/// A git object id (hex).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Oid(String);

impl Oid {
    /// Parses a full hex object id (SHA-1 or SHA-256).
    pub fn parse(hex: &str) -> Option<Self> {
        let hex = hex.trim();
        let valid = matches!(hex.len(), 40 | 64) && hex.bytes().all(|b| b.is_ascii_hexdigit());
        valid.then(|| Self(hex.to_ascii_lowercase()))
    }

    /// The hex text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Oid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<Oid> for String {
    fn from(oid: Oid) -> Self {
        oid.0
    }
}

fn parse_oid(text: &str, what: &str) -> Result<Oid, Error> {
    Oid::parse(text).ok_or_else(|| Error::Git {
        command: what.to_owned(),
        code: Some(0),
        stderr: format!("unexpected output `{}`", text.trim()),
    })
}

fn utf8(path: &Path) -> Result<&str, Error> {
    path.to_str().ok_or_else(|| Error::NonUtf8Path {
        path: path.to_path_buf(),
    })
}

/// The result of [`Repo::integrate`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Integration {
    /// The target branch's new head (or its unchanged head when the source was already in it).
    pub commit: Oid,
    /// True when the branch was fast-forwarded (or already contained the source): no merge
    /// commit was made.
    pub fast_forward: bool,
}

/// A git repository with a work tree, addressed by its top directory.
#[derive(Debug, Clone)]
pub struct Repo {
    root: PathBuf,
    git: Git,
}

impl Repo {
    /// Opens the repository whose work tree top is `path`.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        let not_a_repo = || Error::NotARepo {
            path: path.to_path_buf(),
        };
        let canonical = tokio::fs::canonicalize(path)
            .await
            .map_err(|_| not_a_repo())?;
        let git = Git::new(&canonical);
        let output = git.run(&["rev-parse", "--show-toplevel"]).await?;
        if !output.success() {
            return Err(not_a_repo());
        }
        let top = tokio::fs::canonicalize(output.stdout_text().trim_end())
            .await
            .map_err(|_| not_a_repo())?;
        if top != canonical {
            return Err(not_a_repo());
        }
        Ok(Self {
            root: canonical,
            git,
        })
    }

    /// Makes `dest` a fresh repository holding a copy of `src` (without `.git`,
    /// `__pycache__`, `node_modules`, `.venv`) committed on `main` as
    /// `troupe: import <name>`. When `dest` already is a repository it is opened as is.
    #[tracing::instrument(skip_all, fields(src = %src.as_ref().display(), dest = %dest.as_ref().display()))]
    pub async fn init_from_template(
        src: impl AsRef<Path>,
        dest: impl AsRef<Path>,
    ) -> Result<Self, Error> {
        let (src, dest) = (src.as_ref().to_path_buf(), dest.as_ref().to_path_buf());
        if dest.join(".git").exists() {
            return Self::open(&dest).await;
        }
        let name = src
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "template".to_owned());
        {
            let (from, to) = (src.clone(), dest.clone());
            tokio::task::spawn_blocking(move || template::copy_tree(&from, &to))
                .await
                .map_err(|err| Error::Io {
                    path: src.clone(),
                    source: std::io::Error::other(err),
                })??;
        }
        let git = Git::new(&dest);
        git.ok(&["init", "-q", "-b", "main"]).await?;
        git.ok(&["add", "-A"]).await?;
        let message = format!("troupe: import {name}");
        git.ok(&[
            "commit",
            "-q",
            "--allow-empty",
            "--no-verify",
            "-m",
            &message,
        ])
        .await?;
        info!(name = %name, "imported template into a new repository");
        Self::open(&dest).await
    }

    /// A bare repository at `path` (a mirror), trusted to exist.
    pub(crate) fn bare(path: PathBuf) -> Self {
        Self {
            git: Git::new(&path),
            root: path,
        }
    }

    pub(crate) fn git(&self) -> &Git {
        &self.git
    }

    /// The work tree's top directory (canonical), or a mirror's directory.
    pub fn path(&self) -> &Path {
        &self.root
    }

    /// Where a full ref (`refs/…`) points, or `None` when it does not exist.
    pub async fn ref_head(&self, full_ref: &str) -> Result<Option<Oid>, Error> {
        let spec = format!("{full_ref}^{{commit}}");
        let args = [
            "rev-parse",
            "--verify",
            "--quiet",
            "--end-of-options",
            &spec,
        ];
        let output = self.git.run(&args).await?;
        match output.exit_code {
            Some(0) => Ok(Some(parse_oid(&output.stdout_text(), "git rev-parse")?)),
            Some(1) => Ok(None),
            _ => Err(failure(&args, &output)),
        }
    }

    /// Resolves a commit-ish to a commit id.
    pub async fn resolve(&self, rev: &str) -> Result<Oid, Error> {
        if rev.is_empty() || rev.starts_with('-') {
            return Err(Error::UnknownRevision {
                rev: rev.to_owned(),
            });
        }
        let spec = format!("{rev}^{{commit}}");
        let output = self
            .git
            .run(&[
                "rev-parse",
                "--verify",
                "--quiet",
                "--end-of-options",
                &spec,
            ])
            .await?;
        if !output.success() {
            return Err(Error::UnknownRevision {
                rev: rev.to_owned(),
            });
        }
        parse_oid(&output.stdout_text(), "git rev-parse")
    }

    pub(crate) async fn check_branch_name(&self, name: &str) -> Result<String, Error> {
        let full = format!("refs/heads/{name}");
        let output = self.git.run(&["check-ref-format", &full]).await?;
        if name.starts_with('-') || !output.success() {
            return Err(Error::InvalidBranchName {
                name: name.to_owned(),
            });
        }
        Ok(full)
    }

    /// Where `name` points, or `None` when the branch does not exist.
    pub async fn branch_head(&self, name: &str) -> Result<Option<Oid>, Error> {
        let full = self.check_branch_name(name).await?;
        let output = self
            .git
            .run(&["rev-parse", "--verify", "--quiet", &full])
            .await?;
        match output.exit_code {
            Some(0) => Ok(Some(parse_oid(&output.stdout_text(), "git rev-parse")?)),
            Some(1) => Ok(None),
            _ => Err(failure(
                &["rev-parse", "--verify", "--quiet", &full],
                &output,
            )),
        }
    }

    /// Creates branch `name` at `oid`. Succeeds when it already points there; fails with
    /// [`Error::BranchExists`] when it points elsewhere.
    pub async fn create_branch(&self, name: &str, oid: &Oid) -> Result<(), Error> {
        let full = self.check_branch_name(name).await?;
        // An empty old value makes update-ref refuse an existing ref: create-if-absent, atomically.
        let output = self
            .git
            .run(&["update-ref", &full, oid.as_str(), ""])
            .await?;
        if output.success() {
            debug!(branch = %name, %oid, "created branch");
            return Ok(());
        }
        match self.branch_head(name).await? {
            Some(current) if &current == oid => Ok(()),
            Some(current) => Err(Error::BranchExists {
                name: name.to_owned(),
                current,
            }),
            None => Err(failure(&["update-ref", &full, oid.as_str(), ""], &output)),
        }
    }

    /// Deletes branch `name` if it still points at `expected`; returns whether it did.
    pub async fn delete_branch(&self, name: &str, expected: &Oid) -> Result<bool, Error> {
        let full = self.check_branch_name(name).await?;
        let output = self
            .git
            .run(&["update-ref", "-d", &full, expected.as_str()])
            .await?;
        Ok(output.success())
    }

    /// How deep `commit` lies on its first-parent chain (a root commit is 1). Each landing on a
    /// session branch deepens it, so depths order the branch's heads.
    pub async fn first_parent_depth(&self, commit: &Oid) -> Result<u64, Error> {
        let text = self
            .git
            .ok(&["rev-list", "--first-parent", "--count", commit.as_str()])
            .await?;
        text.trim().parse().map_err(|_| Error::Git {
            command: "git rev-list --count".to_owned(),
            code: Some(0),
            stderr: format!("unexpected output `{text}`"),
        })
    }

    /// Whether `ancestor` is reachable from `descendant` (a commit is its own ancestor).
    pub async fn is_ancestor(&self, ancestor: &Oid, descendant: &Oid) -> Result<bool, Error> {
        let args = [
            "merge-base",
            "--is-ancestor",
            ancestor.as_str(),
            descendant.as_str(),
        ];
        let output = self.git.run(&args).await?;
        match output.exit_code {
            Some(0) => Ok(true),
            Some(1) => Ok(false),
            _ => Err(failure(&args, &output)),
        }
    }

    /// Adds a worktree at `path` on `branch`, created at `start` or reset to it when it
    /// already exists (a previous attempt's branch).
    #[tracing::instrument(skip_all, fields(path = %path.as_ref().display(), branch = %branch, start = %start))]
    pub async fn add_worktree(
        &self,
        path: impl AsRef<Path>,
        branch: &str,
        start: &Oid,
    ) -> Result<Worktree, Error> {
        let path = path.as_ref();
        self.check_branch_name(branch).await?;
        // `--force`: a crashed attempt may still have the branch checked out in a stale worktree.
        let args = [
            "worktree",
            "add",
            "-q",
            "--force",
            "-B",
            branch,
            utf8(path)?,
            start.as_str(),
        ];
        self.worktree_add(path, &args).await
    }

    /// Adds a worktree at `path` with `oid` checked out and no branch.
    #[tracing::instrument(skip_all, fields(path = %path.as_ref().display(), oid = %oid))]
    pub async fn add_detached_worktree(
        &self,
        path: impl AsRef<Path>,
        oid: &Oid,
    ) -> Result<Worktree, Error> {
        let path = path.as_ref();
        let args = [
            "worktree",
            "add",
            "-q",
            "--detach",
            utf8(path)?,
            oid.as_str(),
        ];
        self.worktree_add(path, &args).await
    }

    /// Runs `work` in a detached worktree of `oid` at `path` (replacing whatever a crashed
    /// run left there), then removes it whatever `work` returned. A failed removal is logged,
    /// not returned: the next run at that path replaces it. The one lifecycle of the
    /// executor's, validator's and test-runner's checkouts.
    pub async fn in_detached_worktree<T, F, Fut>(
        &self,
        path: &Path,
        oid: &Oid,
        work: F,
    ) -> Result<T, Error>
    where
        F: FnOnce(Worktree) -> Fut,
        Fut: std::future::Future<Output = T>,
    {
        if let Some(parent) = path.parent() {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(|source| Error::Io {
                    path: parent.to_owned(),
                    source,
                })?;
        }
        self.remove_worktree(path).await?;
        let worktree = self.add_detached_worktree(path, oid).await?;
        Ok(self.run_then_remove(worktree, work).await)
    }

    /// [`Repo::in_detached_worktree`] at a path the caller claimed by creating it, empty (of
    /// several runs wanting one path, the one whose `mkdir` succeeded): nothing stale is there
    /// to replace, and removing it first would give the claim away. If the worktree cannot be
    /// added, the path is released again.
    pub async fn in_claimed_detached_worktree<T, F, Fut>(
        &self,
        path: &Path,
        oid: &Oid,
        work: F,
    ) -> Result<T, Error>
    where
        F: FnOnce(Worktree) -> Fut,
        Fut: std::future::Future<Output = T>,
    {
        let worktree = match self.add_detached_worktree(path, oid).await {
            Ok(worktree) => worktree,
            Err(err) => {
                if let Err(release) = tokio::fs::remove_dir(path).await {
                    tracing::warn!(path = %path.display(), error = %release, "cannot release a claimed worktree path");
                }
                return Err(err);
            }
        };
        Ok(self.run_then_remove(worktree, work).await)
    }

    async fn run_then_remove<T, F, Fut>(&self, worktree: Worktree, work: F) -> T
    where
        F: FnOnce(Worktree) -> Fut,
        Fut: std::future::Future<Output = T>,
    {
        let path = worktree.path().to_owned();
        let output = work(worktree).await;
        if let Err(err) = self.remove_worktree(&path).await {
            tracing::warn!(worktree = %path.display(), error = %err, "cannot remove worktree");
        }
        output
    }

    /// Runs `git worktree add`. Git's worktree bookkeeping is not safe against concurrent
    /// changes (an `add` reading another's half-written `.git/worktrees/<id>` fails), so adds,
    /// removes and prunes of one repository take turns in this process, and an add that still
    /// trips over another process's worktree is retried a few times.
    async fn worktree_add(&self, path: &Path, args: &[&str]) -> Result<Worktree, Error> {
        let lock = worktree_lock(&self.root);
        let _turn = lock.lock().await;
        let mut attempt = 0;
        loop {
            attempt += 1;
            // Records of worktrees whose directories are gone would block re-adding the path.
            self.git.ok(&["worktree", "prune"]).await?;
            let output = self.git.run(args).await?;
            if output.success() {
                break;
            }
            let stderr = output.stderr_text();
            let racy = stderr.contains("worktrees/") && !path.exists();
            if !racy || attempt >= WORKTREE_ATTEMPTS {
                return Err(failure(args, &output));
            }
            debug!(attempt, stderr = %stderr.trim(), "worktree add raced with another process; retrying");
            tokio::time::sleep(std::time::Duration::from_millis(50 * attempt as u64)).await;
        }
        Worktree::new(path).await
    }

    /// Removes the worktree at `path` (discarding any changes in it) and prunes stale
    /// worktree records. A path that does not exist is fine.
    #[tracing::instrument(skip_all, fields(path = %path.as_ref().display()))]
    pub async fn remove_worktree(&self, path: impl AsRef<Path>) -> Result<(), Error> {
        let path = path.as_ref();
        let lock = worktree_lock(&self.root);
        let _turn = lock.lock().await;
        if path.exists() {
            // Twice `--force` also removes a locked worktree.
            let args = ["worktree", "remove", "--force", "--force", utf8(path)?];
            let output = self.git.run(&args).await?;
            if !output.success() && path.exists() {
                // Not (or no longer) a registered worktree: remove the directory ourselves.
                debug!(stderr = %output.stderr_text().trim(), "worktree remove failed; deleting directory");
                tokio::fs::remove_dir_all(path)
                    .await
                    .map_err(|source| Error::Io {
                        path: path.to_path_buf(),
                        source,
                    })?;
            }
        }
        self.git.ok(&["worktree", "prune"]).await?;
        Ok(())
    }

    /// Paths that differ between two commits, relative to the repository root.
    pub async fn changed_paths(&self, from: &Oid, to: &Oid) -> Result<Vec<String>, Error> {
        let text = self
            .git
            .ok(&[
                "diff",
                "--name-only",
                "-z",
                "--no-renames",
                from.as_str(),
                to.as_str(),
                "--",
            ])
            .await?;
        Ok(text
            .split('\0')
            .filter(|p| !p.is_empty())
            .map(str::to_owned)
            .collect())
    }

    /// The content of `path` at `rev`, or `None` when it does not exist there.
    pub async fn read_file(&self, rev: &Oid, path: &str) -> Result<Option<Vec<u8>>, Error> {
        let spec = format!("{rev}:{path}");
        let output = self.git.run(&["cat-file", "blob", &spec]).await?;
        Ok(output.success().then_some(output.stdout))
    }

    /// Whether anything (a file, a directory, a submodule) is at `path` in `rev`.
    pub async fn path_exists(&self, rev: &Oid, path: &str) -> Result<bool, Error> {
        let spec = format!("{rev}:{path}");
        Ok(self.git.run(&["cat-file", "-e", &spec]).await?.success())
    }

    /// Integrates `source` into `target`: fast-forward when possible, else a merge commit with
    /// parents (old head, source) and `message`. Works on objects and refs only, so no checkout
    /// changes; concurrent integrations into the same branch all land (compare-and-swap with
    /// retry). A conflicting merge fails with [`Error::Conflict`] and leaves the branch alone.
    #[tracing::instrument(skip_all, fields(target = %target, source = %source))]
    pub async fn integrate(
        &self,
        target: &str,
        source: &Oid,
        message: &str,
    ) -> Result<Integration, Error> {
        let full = self.check_branch_name(target).await?;
        for attempt in 1..=INTEGRATE_ATTEMPTS {
            let old = self
                .branch_head(target)
                .await?
                .ok_or_else(|| Error::BranchMissing {
                    name: target.to_owned(),
                })?;
            if self.is_ancestor(source, &old).await? {
                debug!(%old, "source already integrated");
                return Ok(Integration {
                    commit: old,
                    fast_forward: true,
                });
            }
            let (new, fast_forward) = if self.is_ancestor(&old, source).await? {
                (source.clone(), true)
            } else {
                (self.merge_commit(&old, source, message).await?, false)
            };
            let output = self
                .git
                .run(&["update-ref", &full, new.as_str(), old.as_str()])
                .await?;
            if output.success() {
                info!(commit = %new, fast_forward, attempt, "integrated");
                return Ok(Integration {
                    commit: new,
                    fast_forward,
                });
            }
            // Lost the race only if the branch moved; anything else is a real failure.
            if self.branch_head(target).await?.as_ref() == Some(&old) {
                return Err(failure(
                    &["update-ref", &full, new.as_str(), old.as_str()],
                    &output,
                ));
            }
            debug!(attempt, "branch moved during integration; retrying");
        }
        Err(Error::Contended {
            branch: target.to_owned(),
            attempts: INTEGRATE_ATTEMPTS,
        })
    }

    /// A merge commit of `ours` and `theirs` built without a work tree.
    pub(crate) async fn merge_commit(
        &self,
        ours: &Oid,
        theirs: &Oid,
        message: &str,
    ) -> Result<Oid, Error> {
        let args = [
            "merge-tree",
            "--write-tree",
            "--name-only",
            "-z",
            "--no-messages",
            ours.as_str(),
            theirs.as_str(),
        ];
        let output = self.git.run(&args).await?;
        let stdout = output.stdout_text();
        let mut fields = stdout.split('\0');
        let tree = fields.next().unwrap_or_default().trim().to_owned();
        match output.exit_code {
            Some(0) => {}
            Some(1) => {
                let mut paths: Vec<String> = fields
                    .filter(|p| !p.is_empty())
                    .map(str::to_owned)
                    .collect();
                paths.dedup();
                return Err(Error::Conflict { paths });
            }
            _ => return Err(failure(&args, &output)),
        }
        let tree = parse_oid(&tree, "git merge-tree")?;
        let commit = self
            .git
            .ok(&[
                "commit-tree",
                tree.as_str(),
                "-p",
                ours.as_str(),
                "-p",
                theirs.as_str(),
                "-m",
                message,
            ])
            .await?;
        parse_oid(&commit, "git commit-tree")
    }
}

/// A checked-out worktree of a [`Repo`].
#[derive(Debug, Clone)]
pub struct Worktree {
    git: Git,
}

impl Worktree {
    async fn new(path: &Path) -> Result<Self, Error> {
        let path = tokio::fs::canonicalize(path)
            .await
            .map_err(|source| Error::Io {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(Self {
            git: Git::new(path),
        })
    }

    /// The worktree's directory (canonical).
    pub fn path(&self) -> &Path {
        self.git.dir()
    }

    /// The commit checked out.
    pub async fn head(&self) -> Result<Oid, Error> {
        let text = self.git.ok(&["rev-parse", "--verify", "HEAD"]).await?;
        parse_oid(&text, "git rev-parse HEAD")
    }

    /// Stages everything (additions, modifications, deletions) and commits it as troupe.
    /// Returns `None` when there was nothing to commit.
    pub async fn commit_all(&self, message: &str) -> Result<Option<Oid>, Error> {
        self.git.ok(&["add", "-A"]).await?;
        let output = self.git.run(&["diff", "--cached", "--quiet"]).await?;
        match output.exit_code {
            Some(0) => return Ok(None),
            Some(1) => {}
            _ => return Err(failure(&["diff", "--cached", "--quiet"], &output)),
        }
        self.git
            .ok(&["commit", "-q", "--no-verify", "-m", message])
            .await?;
        self.head().await.map(Some)
    }

    /// What differs from `commit` here: the paths of uncommitted changes (untracked files
    /// included) and of commits made on top of it. Empty when the checkout is as it was.
    pub async fn changes_since(&self, commit: &Oid) -> Result<Vec<String>, Error> {
        let mut paths: Vec<String> = self
            .git
            .ok(&["status", "--porcelain=v1", "-z", "--untracked-files=all"])
            .await?
            .split('\0')
            .filter(|entry| entry.len() > 3)
            .map(|entry| entry[3..].to_owned())
            .collect();
        let head = self.head().await?;
        if &head != commit {
            let diff = self
                .git
                .ok(&[
                    "diff",
                    "--name-only",
                    "-z",
                    commit.as_str(),
                    head.as_str(),
                    "--",
                ])
                .await?;
            paths.extend(
                diff.split('\0')
                    .filter(|p| !p.is_empty())
                    .map(str::to_owned),
            );
        }
        paths.sort();
        paths.dedup();
        Ok(paths)
    }

    /// Stages everything and folds it into the checked-out commit (same message and parent),
    /// so additions such as a task's summary travel in the task's one commit.
    pub async fn amend_all(&self) -> Result<Oid, Error> {
        self.git.ok(&["add", "-A"]).await?;
        self.git
            .ok(&["commit", "-q", "--no-verify", "--amend", "--no-edit"])
            .await?;
        self.head().await
    }
}

#[cfg(test)]
mod fence_tests;
#[cfg(test)]
mod tests;
