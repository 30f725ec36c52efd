//! A new session's repositories: each plan repository becomes a remote (a URL, or an absolute
//! path that git treats as a local remote) with the commit its session branch starts from,
//! resolved once at intake with `git ls-remote` so every worker starts from the same commit.
//!
//! The coordinator reads no repository contents and clones nothing. It writes only for a
//! `template` repository (copied into a fresh repository under its data dir, which makes it a
//! single-machine repository) and, for local remotes, the session branch at its base, so a
//! user sees it at once; for a URL the first landing creates it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use troupe_plan::{Access, Plan, RepoSource};
use troupe_proto::v1 as pb;
use troupe_workspace::{Credentials, Oid, Remote, Repo};

use crate::Error;

/// A repository resolved for a new session.
#[derive(Debug)]
pub(crate) struct ResolvedRepo {
    pub(crate) name: String,
    pub(crate) remote: Remote,
    pub(crate) access: Access,
    /// The commit the session branch starts from (`None` only on a dry run of a template).
    pub(crate) base_commit: Option<Oid>,
}

impl ResolvedRepo {
    /// The wire form, with the session branch `branch`.
    pub(crate) fn to_proto(&self, branch: &str) -> pb::SessionRepo {
        pb::SessionRepo {
            name: self.name.clone(),
            path: self
                .remote
                .local_path()
                .map(|path| path.display().to_string())
                .unwrap_or_default(),
            url: self.remote.to_string(),
            base_commit: self
                .base_commit
                .as_ref()
                .map(ToString::to_string)
                .unwrap_or_default(),
            branch: branch.to_owned(),
            access: match self.access {
                Access::Write => pb::RepoAccess::Write,
                Access::Read => pb::RepoAccess::Read,
            } as i32,
            ..pb::SessionRepo::default()
        }
    }
}

/// What intake needs to resolve repositories.
pub(crate) struct Intake<'a> {
    /// Where relative `path` and `template` repositories are (the plan's directory, when this
    /// machine can see it).
    pub(crate) base_dir: Option<&'a Path>,
    /// Repositories given by name (the CLI's `--repo NAME=PATH|URL`; `""` for the first).
    pub(crate) overrides: &'a HashMap<String, String>,
    /// Validate only: copy no template.
    pub(crate) dry_run: bool,
    /// Where template repositories are made.
    pub(crate) data_dir: &'a Path,
    /// How to read private remotes.
    pub(crate) credentials: &'a Credentials,
}

impl Intake<'_> {
    /// Resolves every plan repository, listing every problem at once.
    pub(crate) async fn resolve(&self, plan: &Plan) -> Result<Vec<ResolvedRepo>, Error> {
        let mut problems = Vec::new();
        let mut unknown: Vec<&String> = self
            .overrides
            .keys()
            .filter(|name| !name.is_empty() && plan.repo(name).is_none())
            .collect();
        unknown.sort();
        for name in unknown {
            problems.push(format!("repo_paths names unknown repo `{name}`"));
        }
        // Resolutions talk to remotes: all at once, not one after another.
        let outcomes = futures::future::join_all(
            plan.repos
                .iter()
                .enumerate()
                .map(|(index, spec)| self.resolve_one(plan, index, spec)),
        )
        .await;
        let mut resolved = Vec::new();
        for outcome in outcomes {
            match outcome {
                Ok(repo) => resolved.push(repo),
                Err(problem) => problems.push(problem),
            }
        }
        if !problems.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "invalid repositories:\n{}",
                problems.join("\n")
            )));
        }
        Ok(resolved)
    }

    fn local(&self, path: &str) -> Option<PathBuf> {
        let path = Path::new(path);
        if path.is_absolute() {
            Some(path.to_path_buf())
        } else {
            self.base_dir.map(|dir| dir.join(path))
        }
    }

    async fn resolve_one(
        &self,
        plan: &Plan,
        index: usize,
        spec: &troupe_plan::RepoSpec,
    ) -> Result<ResolvedRepo, String> {
        let name = &spec.name;
        // The empty key overrides the default (first) repository: the CLI's `--repo`.
        let given = self.overrides.get(name).or_else(|| {
            if index == 0 {
                self.overrides.get("")
            } else {
                None
            }
        });
        let source = match given {
            Some(text) if text.contains("://") => RepoSource::Url(text.clone()),
            Some(path) => RepoSource::Path(path.clone()),
            None => spec.source.clone(),
        };
        let remote = match &source {
            RepoSource::Url(url) => {
                Remote::parse(url).map_err(|err| format!("repo `{name}`: {err}"))?
            }
            RepoSource::Path(path) => {
                let path = self.local(path).ok_or_else(|| {
                    format!("repo `{name}`: relative path `{path}` needs base_dir")
                })?;
                let path = std::fs::canonicalize(&path).map_err(|err| {
                    format!(
                        "repo `{name}`: {} is not a git repository ({err})",
                        path.display()
                    )
                })?;
                let remote =
                    Remote::from_path(&path).map_err(|err| format!("repo `{name}`: {err}"))?;
                if Repo::open(&path).await.is_err() && !path.join("HEAD").is_file() {
                    return Err(format!(
                        "repo `{name}`: {} is not a git repository",
                        path.display()
                    ));
                }
                remote
            }
            RepoSource::Template(template) => {
                let source = self.local(template).ok_or_else(|| {
                    format!("repo `{name}`: relative template `{template}` needs base_dir")
                })?;
                if !source.is_dir() {
                    return Err(format!(
                        "repo `{name}`: template directory {} does not exist",
                        source.display()
                    ));
                }
                let dest = self.data_dir.join("repos").join(&plan.name).join(name);
                if self.dry_run {
                    // Store nothing on a dry run: report the copy the run would make.
                    return Ok(ResolvedRepo {
                        name: name.clone(),
                        remote: Remote::from_path(&dest).map_err(|err| err.to_string())?,
                        access: spec.access,
                        base_commit: None,
                    });
                }
                let repo = Repo::init_from_template(&source, &dest)
                    .await
                    .map_err(|err| {
                        format!("repo `{name}`: template {}: {err}", source.display())
                    })?;
                Remote::from_path(repo.path()).map_err(|err| format!("repo `{name}`: {err}"))?
            }
        };
        let base = match remote.resolve(self.credentials, spec.base.as_deref()).await {
            Ok(base) => base,
            Err(troupe_workspace::Error::UnknownRevision { rev }) => {
                return Err(match spec.base.as_deref() {
                    None => {
                        format!("repo `{name}`: {remote} has no HEAD commit (an empty repository?)")
                    }
                    Some(_) => format!(
                        "repo `{name}`: base `{rev}` does not name a commit in {remote} (an \
                         imported session starts from the exported session's branch: fetch it \
                         into this repository, or remove `base` to start at HEAD)"
                    ),
                });
            }
            Err(err) => return Err(format!("repo `{name}`: {err}")),
        };
        Ok(ResolvedRepo {
            name: name.clone(),
            remote,
            access: spec.access,
            base_commit: Some(base),
        })
    }
}

/// Creates the session branch at its base in every local remote (a URL's comes with its first
/// landing). On failure, deletes the ones it made, so nothing is half-created.
pub(crate) async fn create_local_branches(
    repos: &[ResolvedRepo],
    branch: &str,
) -> Result<Vec<(Repo, Oid)>, Error> {
    let mut created: Vec<(Repo, Oid)> = Vec::new();
    for resolved in repos {
        let (Some(path), Some(base)) = (resolved.remote.local_path(), &resolved.base_commit) else {
            continue;
        };
        let repo = match Repo::open(path).await {
            Ok(repo) => repo,
            // A bare local remote: its first landing makes the branch, as for a URL.
            Err(_) => continue,
        };
        if let Err(err) = repo.create_branch(branch, base).await {
            delete_branches(&created, branch).await;
            return Err(err.into());
        }
        created.push((repo, base.clone()));
    }
    Ok(created)
}

/// Deletes session branches made for a session that was then not stored, where they still
/// point where they were made.
pub(crate) async fn delete_branches(created: &[(Repo, Oid)], branch: &str) {
    for (repo, base) in created {
        match repo.delete_branch(branch, base).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(repo = %repo.path().display(), branch, "session branch moved; left in place")
            }
            Err(err) => {
                tracing::warn!(repo = %repo.path().display(), branch, error = %err, "could not delete session branch")
            }
        }
    }
}
