//! Fenced publication against real repositories: a `path` remote with a checkout (as a user's
//! repository), worker mirrors in their own directories.

use std::fs;
use tokio::time::Instant;

use super::*;

struct Setup {
    root: tempfile::TempDir,
    remote: Remote,
    origin: Repo,
    base: Oid,
}

const SESSION: &str = "s-1";
const BRANCH: &str = "troupe/s-1";

async fn setup() -> Setup {
    let root = tempfile::tempdir().expect("tempdir");
    let template = root.path().join("template");
    fs::create_dir_all(&template).expect("mkdir");
    fs::write(template.join("a.txt"), "one\ntwo\nthree\n").expect("write");
    let origin = Repo::init_from_template(&template, root.path().join("origin"))
        .await
        .expect("init");
    let base = origin.resolve("HEAD").await.expect("head");
    origin.create_branch(BRANCH, &base).await.expect("branch");
    let remote = Remote::from_path(origin.path()).expect("remote");
    Setup {
        root,
        remote,
        origin,
        base,
    }
}

impl Setup {
    async fn mirror(&self, worker: &str) -> Mirror {
        Mirrors::new(self.root.path().join(worker).join("mirrors"))
            .open(&self.remote)
            .await
            .expect("mirror")
    }

    /// A commit made in `mirror`'s worktree from the session base, writing `files`.
    async fn commit(&self, mirror: &Mirror, name: &str, files: &[(&str, &str)]) -> Oid {
        mirror.fetch_session(SESSION).await.expect("fetch");
        let path = self
            .root
            .path()
            .join(format!("wt-{name}-{}", rand_suffix()));
        let wt = mirror
            .repo()
            .add_detached_worktree(&path, &self.base)
            .await
            .expect("worktree");
        for (file, content) in files {
            fs::write(wt.path().join(file), content).expect("write");
        }
        let oid = wt
            .commit_all(&format!("{name}: change"))
            .await
            .expect("commit")
            .expect("a change");
        mirror.repo().remove_worktree(&path).await.expect("remove");
        oid
    }

    async fn head(&self) -> Oid {
        self.origin
            .branch_head(BRANCH)
            .await
            .expect("head")
            .expect("branch")
    }

    /// Subjects of the commits on the session branch since the base.
    async fn subjects(&self) -> Vec<String> {
        let range = format!("{}..{BRANCH}", self.base);
        let text = self
            .origin
            .git()
            .ok(&["log", "--format=%s", &range])
            .await
            .expect("log");
        text.lines().map(str::to_owned).collect()
    }
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

fn attempt(task: &str, attempt: u32, token: u64) -> Attempt {
    Attempt {
        session: SESSION.to_owned(),
        task: task.to_owned(),
        attempt,
        token,
    }
}

/// A lease that lapsed: the coordinator no longer confirms it.
#[derive(Debug)]
struct Lapsed;

impl Lease for Lapsed {
    fn confirm(
        &self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Instant, String>> + Send + '_>>
    {
        Box::pin(async { Err("stale fencing token".to_owned()) })
    }
}

fn publication<'a>(s: &'a Setup, commit: &'a Oid, part: Option<&'a str>) -> Publication<'a> {
    Publication {
        session_branch: BRANCH,
        base: &s.base,
        commit,
        task_branch: None,
        message: "troupe: integrate",
        part,
    }
}

async fn held(mirror: &Mirror, attempt: &Attempt) -> Held {
    match mirror.claim(attempt).await.expect("claim") {
        Claim::Held(held) => held,
        Claim::Landed(landed) => panic!("unexpectedly landed: {landed:?}"),
    }
}

#[tokio::test]
async fn a_landed_task_is_adopted_by_the_next_attempt_not_landed_again() {
    let s = setup().await;
    let a = s.mirror("a").await;
    let first = attempt("IMPL-1", 1, 1);
    let mut hold = held(&a, &first).await;
    let commit = s.commit(&a, "IMPL-1", &[("x.txt", "x\n")]).await;
    let mut publication = publication(&s, &commit, None);
    publication.task_branch = Some("troupe-task/s-1/IMPL-1");
    let landed = a
        .publish(&mut hold, &publication, &Unleased)
        .await
        .expect("publish");
    assert!(landed.fast_forward);
    assert_eq!(s.head().await, commit);
    assert_eq!(
        s.origin
            .branch_head("troupe-task/s-1/IMPL-1")
            .await
            .expect("head"),
        Some(commit.clone())
    );

    // The completion was lost; the coordinator hands the task out again, elsewhere.
    let b = s.mirror("b").await;
    match b.claim(&attempt("IMPL-1", 2, 2)).await.expect("claim") {
        Claim::Landed(again) => {
            assert_eq!(
                (again.head, again.commit, again.attempt),
                (commit.clone(), commit, 1)
            );
        }
        Claim::Held(_) => panic!("a landed task was claimed for another run"),
    }
    assert_eq!(s.subjects().await, ["IMPL-1: change"]);
}

#[tokio::test]
async fn a_stale_attempt_never_lands_once_a_newer_one_claimed() {
    let s = setup().await;
    let (a, b) = (s.mirror("a").await, s.mirror("b").await);
    let mut stale = held(&a, &attempt("IMPL-1", 1, 1)).await;
    let stale_commit = s.commit(&a, "IMPL-1 stale", &[("x.txt", "stale\n")]).await;

    let mut current = held(&b, &attempt("IMPL-1", 2, 2)).await;
    let err = a
        .publish(&mut stale, &publication(&s, &stale_commit, None), &Unleased)
        .await
        .expect_err("stale");
    assert!(
        matches!(
            err,
            Error::Superseded {
                ours: 1,
                theirs: 2,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        s.head().await,
        s.base,
        "nothing of the stale attempt landed"
    );

    let commit = s.commit(&b, "IMPL-1", &[("x.txt", "fresh\n")]).await;
    b.publish(&mut current, &publication(&s, &commit, None), &Unleased)
        .await
        .expect("publish");
    assert_eq!(s.subjects().await, ["IMPL-1: change"]);

    // An even older attempt cannot claim at all.
    let err = a
        .claim(&attempt("IMPL-1", 1, 1))
        .await
        .expect_err("stale claim");
    assert!(matches!(err, Error::Superseded { .. }), "{err}");
}

#[tokio::test]
async fn concurrent_tasks_from_several_workers_all_land_once() {
    let s = std::sync::Arc::new(setup().await);
    let mut tasks = tokio::task::JoinSet::new();
    for n in 0..8 {
        let s = std::sync::Arc::clone(&s);
        tasks.spawn(async move {
            let mirror = s.mirror(if n % 2 == 0 { "a" } else { "b" }).await;
            let task = format!("IMPL-{n}");
            let mut hold = held(&mirror, &attempt(&task, 1, 1)).await;
            let commit = s
                .commit(&mirror, &task, &[(&format!("f{n}.txt"), "content\n")])
                .await;
            mirror
                .publish(&mut hold, &publication(&s, &commit, None), &Unleased)
                .await
                .expect("publish");
        });
    }
    while let Some(joined) = tasks.join_next().await {
        joined.expect("task");
    }
    let subjects = s.subjects().await;
    for n in 0..8 {
        let wanted = format!("IMPL-{n}: change");
        assert_eq!(
            subjects.iter().filter(|s| **s == wanted).count(),
            1,
            "{subjects:?}"
        );
    }
    let merges: Vec<_> = subjects
        .iter()
        .filter(|s| s.starts_with("troupe: integrate"))
        .collect();
    assert!(
        !merges.is_empty(),
        "parallel tasks need merges: {subjects:?}"
    );
}

#[tokio::test]
async fn a_lost_answer_is_recognised_as_this_attempts_own_landing() {
    let s = setup().await;
    let a = s.mirror("a").await;
    let mut hold = held(&a, &attempt("IMPL-1", 1, 1)).await;
    let before = hold.clone();
    let commit = s.commit(&a, "IMPL-1", &[("x.txt", "x\n")]).await;
    let first = a
        .publish(&mut hold, &publication(&s, &commit, None), &Unleased)
        .await
        .expect("publish");
    // The same attempt publishes again as if the first push's answer never came.
    let mut replay = before;
    let again = a
        .publish(&mut replay, &publication(&s, &commit, None), &Unleased)
        .await
        .expect("replay");
    assert_eq!(again, first);
    assert_eq!(s.subjects().await.len(), 1);
}

#[tokio::test]
async fn a_conflict_names_the_paths_and_lands_nothing() {
    let s = setup().await;
    let a = s.mirror("a").await;
    let mut one = held(&a, &attempt("IMPL-1", 1, 1)).await;
    let mut two = held(&a, &attempt("IMPL-2", 1, 1)).await;
    let c1 = s.commit(&a, "IMPL-1", &[("a.txt", "uno\n")]).await;
    let c2 = s.commit(&a, "IMPL-2", &[("a.txt", "eins\n")]).await;
    a.publish(&mut one, &publication(&s, &c1, None), &Unleased)
        .await
        .expect("first");
    let err = a
        .publish(&mut two, &publication(&s, &c2, None), &Unleased)
        .await
        .expect_err("conflict");
    assert!(
        matches!(&err, Error::Conflict { paths } if paths == &["a.txt"]),
        "{err}"
    );
    assert_eq!(s.head().await, c1);
}

#[tokio::test]
async fn an_attempt_whose_lease_lapsed_publishes_nothing() {
    let s = setup().await;
    let a = s.mirror("a").await;
    let mut hold = held(&a, &attempt("IMPL-1", 1, 1)).await;
    let commit = s.commit(&a, "IMPL-1", &[("x.txt", "x\n")]).await;
    let err = a
        .publish(&mut hold, &publication(&s, &commit, None), &Lapsed)
        .await
        .expect_err("deadline");
    assert!(matches!(err, Error::LeaseExpired { .. }), "{err}");
    assert_eq!(s.head().await, s.base);
}

#[tokio::test]
async fn parts_landed_by_an_earlier_attempt_are_known_to_the_next() {
    let s = setup().await;
    let a = s.mirror("a").await;
    let mut first = held(&a, &attempt("EXEC-1", 1, 1)).await;
    let part = s.commit(&a, "IMPL-101", &[("p.txt", "p\n")]).await;
    a.publish(
        &mut first,
        &publication(&s, &part, Some("IMPL-101")),
        &Unleased,
    )
    .await
    .expect("part");
    assert!(first.landed_part("IMPL-101").is_some());

    let b = s.mirror("b").await;
    let second = held(&b, &attempt("EXEC-1", 2, 2)).await;
    let landed = second.landed_part("IMPL-101").expect("known part");
    assert_eq!((&landed.commit, landed.attempt), (&part, 1));
    assert!(second.landed_part("IMPL-102").is_none());
}

#[tokio::test]
async fn a_missing_session_branch_starts_at_the_base() {
    let s = setup().await;
    let fresh = "troupe/s-1-fresh";
    let a = s.mirror("a").await;
    let mut hold = held(&a, &attempt("IMPL-1", 1, 1)).await;
    let commit = s.commit(&a, "IMPL-1", &[("x.txt", "x\n")]).await;
    let mut publication = publication(&s, &commit, None);
    publication.session_branch = fresh;
    a.publish(&mut hold, &publication, &Unleased)
        .await
        .expect("publish");
    assert_eq!(
        s.origin.branch_head(fresh).await.expect("head"),
        Some(commit)
    );
}

#[tokio::test]
async fn unreachable_remotes_and_refusing_hooks_are_errors_not_races() {
    let s = setup().await;
    let mirrors = Mirrors::new(s.root.path().join("c"));
    let gone = Remote::parse(&format!("{}/nowhere", s.root.path().display())).expect("remote");
    let err = mirrors.open(&gone).await.expect_err("no repository");
    assert!(matches!(err, Error::NotARepo { .. }), "{err}");
    // Nothing listens on port 1.
    let closed = Remote::parse("git://127.0.0.1:1/app.git").expect("remote");
    let mirror = mirrors.open(&closed).await.expect("mirror");
    let err = mirror
        .claim(&attempt("IMPL-1", 1, 1))
        .await
        .expect_err("unreachable");
    assert!(
        matches!(&err, Error::Unreachable { remote, .. } if remote.ends_with("app.git")),
        "{err}"
    );

    let hooks = s.origin.path().join(".git/hooks");
    fs::write(
        hooks.join("pre-receive"),
        "#!/bin/sh\necho 'branch is protected' >&2\nexit 1\n",
    )
    .expect("hook");
    let mut perms = fs::metadata(hooks.join("pre-receive"))
        .expect("meta")
        .permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    fs::set_permissions(hooks.join("pre-receive"), perms).expect("chmod");
    let a = s.mirror("a").await;
    let err = a
        .claim(&attempt("IMPL-1", 1, 1))
        .await
        .expect_err("refused");
    assert!(matches!(err, Error::PushRejected { .. }), "{err}");
}

#[tokio::test]
async fn parts_of_one_attempt_publish_concurrently_each_once() {
    let s = std::sync::Arc::new(setup().await);
    let a = s.mirror("a").await;
    let hold = held(&a, &attempt("EXEC-1", 1, 1)).await;
    let mut parts = tokio::task::JoinSet::new();
    for n in 0..4 {
        let (s, a, mut hold) = (std::sync::Arc::clone(&s), a.clone(), hold.clone());
        parts.spawn(async move {
            let name = format!("IMPL-10{n}");
            let commit = s.commit(&a, &name, &[(&format!("p{n}.txt"), "p\n")]).await;
            a.publish(&mut hold, &publication(&s, &commit, Some(&name)), &Unleased)
                .await
                .expect("part");
        });
    }
    while let Some(joined) = parts.join_next().await {
        joined.expect("part");
    }
    let subjects = s.subjects().await;
    for n in 0..4 {
        let wanted = format!("IMPL-10{n}: change");
        assert_eq!(
            subjects.iter().filter(|s| **s == wanted).count(),
            1,
            "{subjects:?}"
        );
    }
    let next = held(&s.mirror("b").await, &attempt("EXEC-1", 2, 2)).await;
    assert!((0..4).all(|n| next.landed_part(&format!("IMPL-10{n}")).is_some()));
}
