use std::fs;
use std::sync::Arc;

use super::*;

/// A template directory with a couple of files and junk that must not be imported.
fn template() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    fs::write(dir.path().join("a.txt"), "one\ntwo\nthree\n").expect("write");
    fs::create_dir_all(dir.path().join("src/__pycache__")).expect("mkdir");
    fs::write(dir.path().join("src/app.py"), "print('hi')\n").expect("write");
    fs::write(dir.path().join("src/__pycache__/app.pyc"), "junk").expect("write");
    fs::create_dir_all(dir.path().join("node_modules/x")).expect("mkdir");
    fs::write(dir.path().join("node_modules/x/i.js"), "junk").expect("write");
    dir
}

async fn repo() -> (tempfile::TempDir, Repo) {
    let src = template();
    let root = tempfile::tempdir().expect("tempdir");
    let repo = Repo::init_from_template(src.path(), root.path().join("repo"))
        .await
        .expect("init");
    (root, repo)
}

/// Makes a commit on a new task branch from `start` that writes `files`.
async fn task_commit(
    repo: &Repo,
    root: &Path,
    name: &str,
    start: &Oid,
    files: &[(&str, &str)],
) -> Oid {
    let path = root.join(format!("wt-{name}"));
    let wt = repo
        .add_worktree(&path, &format!("task/{name}"), start)
        .await
        .expect("worktree");
    for (file, content) in files {
        let target = wt.path().join(file);
        if let Some(parent) = target.parent() {
            fs::create_dir_all(parent).expect("mkdir");
        }
        fs::write(target, content).expect("write");
    }
    let oid = wt
        .commit_all(&format!("{name}: change"))
        .await
        .expect("commit")
        .expect("something to commit");
    repo.remove_worktree(&path).await.expect("remove");
    oid
}

#[tokio::test]
async fn open_requires_the_top_of_a_work_tree() {
    let (root, repo) = repo().await;
    assert!(Repo::open(repo.path()).await.is_ok());
    let err = Repo::open(repo.path().join("src"))
        .await
        .expect_err("subdirectory");
    assert!(matches!(err, Error::NotARepo { .. }), "{err}");
    let err = Repo::open(root.path()).await.expect_err("not a repo");
    assert!(matches!(err, Error::NotARepo { .. }), "{err}");
    let err = Repo::open(root.path().join("missing"))
        .await
        .expect_err("missing");
    assert!(matches!(err, Error::NotARepo { .. }), "{err}");
}

#[tokio::test]
async fn template_import_skips_junk_and_is_idempotent() {
    let src = template();
    let root = tempfile::tempdir().expect("tempdir");
    let dest = root.path().join("repo");
    let repo = Repo::init_from_template(src.path(), &dest)
        .await
        .expect("init");
    let head = repo.resolve("main").await.expect("main exists");
    assert_eq!(
        repo.read_file(&head, "a.txt").await.expect("read"),
        Some(b"one\ntwo\nthree\n".to_vec())
    );
    assert!(
        repo.read_file(&head, "src/app.py")
            .await
            .expect("read")
            .is_some()
    );
    assert_eq!(
        repo.read_file(&head, "src/__pycache__/app.pyc")
            .await
            .expect("read"),
        None
    );
    assert_eq!(
        repo.read_file(&head, "node_modules/x/i.js")
            .await
            .expect("read"),
        None
    );
    let name = src
        .path()
        .file_name()
        .expect("name")
        .to_string_lossy()
        .into_owned();
    let subject = repo
        .git
        .ok(&["log", "-1", "--format=%s%n%an <%ae>", "main"])
        .await
        .expect("log");
    assert_eq!(
        subject,
        format!("troupe: import {name}\ntroupe <troupe@localhost>")
    );

    // A second import opens the existing repository instead of re-importing.
    fs::write(dest.join("extra.txt"), "x").expect("write");
    let again = Repo::init_from_template(src.path(), &dest)
        .await
        .expect("open");
    assert_eq!(again.resolve("HEAD").await.expect("head"), head);
}

#[tokio::test]
async fn resolve_and_branches() {
    let (_root, repo) = repo().await;
    let head = repo.resolve("HEAD").await.expect("head");
    assert_eq!(repo.resolve(head.as_str()).await.expect("oid"), head);
    assert!(matches!(
        repo.resolve("nope").await,
        Err(Error::UnknownRevision { .. })
    ));
    assert!(matches!(
        repo.resolve("--all").await,
        Err(Error::UnknownRevision { .. })
    ));

    assert_eq!(repo.branch_head("troupe/s1").await.expect("lookup"), None);
    repo.create_branch("troupe/s1", &head)
        .await
        .expect("create");
    repo.create_branch("troupe/s1", &head)
        .await
        .expect("same target is fine");
    assert_eq!(
        repo.branch_head("troupe/s1").await.expect("lookup"),
        Some(head.clone())
    );
    assert!(matches!(
        repo.create_branch("bad..name", &head).await,
        Err(Error::InvalidBranchName { .. })
    ));

    let other = task_commit(&repo, _root.path(), "b", &head, &[("b.txt", "b")]).await;
    let err = repo
        .create_branch("troupe/s1", &other)
        .await
        .expect_err("points elsewhere");
    assert!(
        matches!(err, Error::BranchExists { ref current, .. } if current == &head),
        "{err}"
    );

    assert!(
        !repo
            .delete_branch("troupe/s1", &other)
            .await
            .expect("cas delete"),
        "moved branch kept"
    );
    assert!(
        repo.delete_branch("troupe/s1", &head)
            .await
            .expect("delete")
    );
    assert_eq!(repo.branch_head("troupe/s1").await.expect("lookup"), None);
}

#[tokio::test]
async fn worktree_commit_and_integrate_fast_forward_then_merge() {
    let (root, repo) = repo().await;
    let base = repo.resolve("main").await.expect("base");
    repo.create_branch("troupe/s", &base)
        .await
        .expect("session branch");

    let first = task_commit(&repo, root.path(), "one", &base, &[("one.txt", "1")]).await;
    assert_eq!(
        repo.changed_paths(&base, &first).await.expect("diff"),
        ["one.txt"]
    );
    let merged = repo
        .integrate("troupe/s", &first, "merge one")
        .await
        .expect("ff");
    assert_eq!(
        merged,
        Integration {
            commit: first.clone(),
            fast_forward: true
        }
    );

    // Made from the old base, so it needs a real merge.
    let second = task_commit(&repo, root.path(), "two", &base, &[("two.txt", "2")]).await;
    let merged = repo
        .integrate("troupe/s", &second, "merge two")
        .await
        .expect("merge");
    assert!(!merged.fast_forward);
    assert_eq!(
        repo.branch_head("troupe/s").await.expect("head"),
        Some(merged.commit.clone())
    );
    assert!(
        repo.is_ancestor(&first, &merged.commit)
            .await
            .expect("ancestry")
    );
    assert!(
        repo.is_ancestor(&second, &merged.commit)
            .await
            .expect("ancestry")
    );
    let mut paths = repo
        .changed_paths(&base, &merged.commit)
        .await
        .expect("diff");
    paths.sort();
    assert_eq!(paths, ["one.txt", "two.txt"]);

    // Integrating again is a no-op.
    let again = repo
        .integrate("troupe/s", &second, "merge two")
        .await
        .expect("no-op");
    assert_eq!(again.commit, merged.commit);

    // The main checkout was never touched.
    assert!(!repo.path().join("one.txt").exists());
    let status = repo
        .git
        .ok(&["status", "--porcelain"])
        .await
        .expect("status");
    assert_eq!(status, "");
}

#[tokio::test]
async fn conflicting_integration_reports_the_paths_and_leaves_the_branch() {
    let (root, repo) = repo().await;
    let base = repo.resolve("main").await.expect("base");
    repo.create_branch("troupe/s", &base)
        .await
        .expect("session branch");
    let left = task_commit(
        &repo,
        root.path(),
        "l",
        &base,
        &[("a.txt", "left\n"), ("l.txt", "l")],
    )
    .await;
    let right = task_commit(
        &repo,
        root.path(),
        "r",
        &base,
        &[("a.txt", "right\n"), ("r.txt", "r")],
    )
    .await;
    repo.integrate("troupe/s", &left, "l")
        .await
        .expect("first lands");
    let err = repo
        .integrate("troupe/s", &right, "r")
        .await
        .expect_err("conflict");
    match err {
        Error::Conflict { paths } => assert_eq!(paths, ["a.txt"]),
        other => panic!("expected a conflict, got {other}"),
    }
    assert_eq!(
        repo.branch_head("troupe/s").await.expect("head"),
        Some(left)
    );
}

#[tokio::test]
async fn concurrent_integrations_all_land() {
    let (root, repo) = repo().await;
    let base = repo.resolve("main").await.expect("base");
    repo.create_branch("troupe/s", &base)
        .await
        .expect("session branch");
    let mut commits = Vec::new();
    for i in 0..8 {
        let file = format!("f{i}.txt");
        commits
            .push(task_commit(&repo, root.path(), &format!("t{i}"), &base, &[(&file, "x")]).await);
    }
    let repo = Arc::new(repo);
    let handles: Vec<_> = commits
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, oid)| {
            let repo = Arc::clone(&repo);
            tokio::spawn(async move {
                repo.integrate("troupe/s", &oid, &format!("merge t{i}"))
                    .await
            })
        })
        .collect();
    for handle in handles {
        handle.await.expect("join").expect("integrates");
    }
    let head = repo
        .branch_head("troupe/s")
        .await
        .expect("head")
        .expect("exists");
    for (i, oid) in commits.iter().enumerate() {
        assert!(
            repo.is_ancestor(oid, &head).await.expect("ancestry"),
            "t{i} lost"
        );
        assert!(
            repo.read_file(&head, &format!("f{i}.txt"))
                .await
                .expect("read")
                .is_some()
        );
    }
}

#[tokio::test]
async fn worktrees_reset_existing_branches_and_detach() {
    let (root, repo) = repo().await;
    let base = repo.resolve("main").await.expect("base");
    let old = task_commit(&repo, root.path(), "t", &base, &[("x.txt", "x")]).await;
    assert_eq!(repo.branch_head("task/t").await.expect("head"), Some(old));

    // A retry starts the same branch over from the base.
    let path = root.path().join("retry");
    let wt = repo
        .add_worktree(&path, "task/t", &base)
        .await
        .expect("reset branch");
    assert_eq!(wt.head().await.expect("head"), base);
    assert_eq!(wt.commit_all("nothing").await.expect("commit"), None);
    fs::remove_file(wt.path().join("a.txt")).expect("delete");
    let deleted = wt
        .commit_all("delete a")
        .await
        .expect("commit")
        .expect("a change");
    assert_eq!(
        repo.changed_paths(&base, &deleted).await.expect("diff"),
        ["a.txt"]
    );
    // Amending folds more into the same commit: one commit on top of the base.
    fs::write(wt.path().join("notes.md"), "summary\n").expect("write");
    let amended = wt.amend_all().await.expect("amend");
    assert_ne!(amended, deleted);
    assert_eq!(
        repo.changed_paths(&base, &amended).await.expect("diff"),
        ["a.txt", "notes.md"]
    );
    assert_eq!(
        repo.resolve(&format!("{}^", amended.as_str()))
            .await
            .expect("parent"),
        base
    );
    repo.remove_worktree(&path).await.expect("remove");
    assert!(!path.exists());
    repo.remove_worktree(&path)
        .await
        .expect("removing twice is fine");

    let detached = root.path().join("detached");
    let wt = repo
        .add_detached_worktree(&detached, &deleted)
        .await
        .expect("detached");
    assert_eq!(wt.head().await.expect("head"), deleted);
    assert!(!wt.path().join("a.txt").exists());
    fs::write(wt.path().join("dirty"), "x").expect("write");
    repo.remove_worktree(&detached)
        .await
        .expect("remove dirty worktree");
    assert!(!detached.exists());
}

#[tokio::test]
async fn concurrent_worktrees_do_not_trip_over_each_other() {
    let (root, repo) = repo().await;
    let base = repo.resolve("main").await.expect("base");
    let repo = Arc::new(repo);
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let repo = Arc::clone(&repo);
            let base = base.clone();
            let path = root.path().join(format!("par-{i}"));
            tokio::spawn(async move {
                let wt = repo.add_worktree(&path, &format!("par/{i}"), &base).await?;
                fs::write(wt.path().join(format!("p{i}.txt")), "x").expect("write");
                let commit = wt.commit_all("par").await?;
                repo.remove_worktree(&path).await?;
                Ok::<_, Error>(commit)
            })
        })
        .collect();
    for handle in handles {
        let commit = handle.await.expect("join").expect("worktree round trip");
        assert!(commit.is_some());
    }
}

#[tokio::test]
async fn path_exists_sees_files_and_directories_but_read_file_only_files() {
    let (_root, repo) = repo().await;
    let head = repo.resolve("HEAD").await.expect("head");
    assert!(repo.path_exists(&head, "a.txt").await.expect("file"));
    assert!(repo.path_exists(&head, "src").await.expect("dir"));
    assert!(
        !repo
            .path_exists(&head, "missing.txt")
            .await
            .expect("absent")
    );
    // A directory is not a file: read_file says None, path_exists says it is there.
    assert_eq!(repo.read_file(&head, "src").await.expect("read"), None);
}

#[tokio::test]
async fn a_detached_worktree_is_there_for_the_work_and_gone_after() {
    let (root, repo) = repo().await;
    let head = repo.resolve("HEAD").await.expect("head");
    let path = root.path().join("checkouts/run-0");
    // What a crashed run left behind is replaced, not an error.
    fs::create_dir_all(path.join("stale")).expect("mkdir");
    let seen = repo
        .in_detached_worktree(&path, &head, |wt| async move {
            (
                wt.path().join("a.txt").is_file(),
                wt.path().join("stale").exists(),
            )
        })
        .await
        .expect("ran");
    assert_eq!(seen, (true, false));
    assert!(!path.exists(), "the worktree outlived its work");
}
