//! The repositories a check reads, each from the validator's own mirror of its remote: the
//! task's own, and those its upstream tasks worked in (a plan may span several).

use std::collections::HashMap;

use troupe_proto::v1::{ClaimedTask, SessionRepo};
use troupe_workspace::{Oid, Remote, Repo};

use crate::Error;
use crate::validate::{Validator, first_parent};

/// One repository as a session left it: the mirror to read, its session head and base.
#[derive(Debug, Clone)]
pub(crate) struct RepoView {
    pub(crate) repo: Repo,
    /// The session branch's head (the base commit while nothing has landed).
    pub(crate) head: Oid,
    /// The commit the session started from.
    pub(crate) base: Option<Oid>,
}

/// The views of a claim's repositories, made on first use.
pub(crate) struct RepoViews<'a> {
    validator: &'a Validator,
    session: String,
    own: Option<SessionRepo>,
    repos: Vec<SessionRepo>,
    views: HashMap<String, RepoView>,
}

impl<'a> RepoViews<'a> {
    pub(crate) fn new(validator: &'a Validator, claimed: &ClaimedTask) -> Self {
        Self {
            validator,
            session: claimed
                .task
                .as_ref()
                .map(|task| task.session_id.clone())
                .unwrap_or_default(),
            own: claimed.repo.clone(),
            repos: claimed.repos.clone(),
            views: HashMap::new(),
        }
    }

    /// The task's own repository.
    pub(crate) async fn own(&mut self) -> Result<RepoView, Error> {
        let own = self
            .own
            .clone()
            .ok_or_else(|| Error::InvalidArgument("claimed task has no repository".to_owned()))?;
        self.view(&own).await
    }

    /// The repository named `name` (an upstream task's); the task's own when unnamed or not
    /// among the session's (claims from before repositories were named).
    pub(crate) async fn named(&mut self, name: &str) -> Result<RepoView, Error> {
        match self.repos.iter().find(|repo| repo.name == name).cloned() {
            Some(repo) if !name.is_empty() => self.view(&repo).await,
            _ => self.own().await,
        }
    }

    async fn view(&mut self, repo: &SessionRepo) -> Result<RepoView, Error> {
        if let Some(view) = self.views.get(&repo.name) {
            return Ok(view.clone());
        }
        let address = if repo.url.is_empty() {
            &repo.path
        } else {
            &repo.url
        };
        let remote = Remote::parse(address)
            .map_err(|err| Error::InvalidArgument(format!("repository {}: {err}", repo.name)))?;
        let mirror = self.validator.mirror(&remote).await?;
        mirror
            .fetch_session_branch(&self.session, &repo.branch)
            .await?;
        let declared = Oid::parse(&repo.base_commit);
        let head = match mirror.repo().branch_head(&repo.branch).await? {
            Some(head) => head,
            None => {
                let base = declared.clone().ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "session branch `{}` does not exist on {remote} and the claim names no base commit",
                        repo.branch
                    ))
                })?;
                mirror.ensure_commit(&base, None).await?;
                base
            }
        };
        let base = match declared {
            Some(base) => Some(base),
            None => first_parent(mirror.repo(), &head).await?,
        };
        let view = RepoView {
            repo: mirror.repo().clone(),
            head,
            base,
        };
        self.views.insert(repo.name.clone(), view.clone());
        Ok(view)
    }
}
