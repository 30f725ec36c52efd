//! A plan repository's `base`: the session branch starts at that revision instead of HEAD
//! (what `troupe import` asks for with an exported session's branch).

use serde_json::json;
use tonic::Code;

use crate::support::{Db, Harness, assert_code, db_tests, t};

fn git(repo: &std::path::Path, args: &[&str]) -> String {
    troupe_testkit::git(repo, args).expect("git")
}

async fn the_session_branch_starts_at_the_plans_base(db: Db) {
    let harness = Harness::start(db).await;
    let repo = harness.base_dir.join("repo");
    // An earlier session's branch, one commit ahead of HEAD.
    git(&repo, &["branch", "troupe/earlier", "HEAD"]);
    git(&repo, &["checkout", "-q", "troupe/earlier"]);
    std::fs::write(repo.join("done.txt"), "work of a completed task\n").expect("write");
    git(&repo, &["add", "done.txt"]);
    git(&repo, &["commit", "-q", "-m", "completed task"]);
    let tip = git(&repo, &["rev-parse", "HEAD"]).trim().to_owned();
    git(&repo, &["checkout", "-q", "-"]);
    assert_ne!(tip, harness.base_commit);

    let created = harness
        .create(
            json!({"name": "based", "repos": {"app": {"path": "repo", "base": "troupe/earlier"}},
            "tasks": [t("IMPL-1", &[])]}),
        )
        .await;
    let session = created.session.expect("session");
    assert_eq!(session.repos[0].base_commit, tip);
    let branch_head = git(&repo, &["rev-parse", &session.repos[0].branch]);
    assert_eq!(branch_head.trim(), tip);
    // The claimed task sees the same repository record.
    let claimed = harness.claim(&[], 1).await;
    assert_eq!(claimed[0].repo.as_ref().expect("repo").base_commit, tip);

    // Without `base`, HEAD as before.
    let plain = harness
        .create(json!({"name": "plain", "tasks": [t("IMPL-1", &[])]}))
        .await;
    assert_eq!(
        plain.session.expect("session").repos[0].base_commit,
        harness.base_commit
    );
    harness.stop().await;
}

async fn a_base_missing_from_the_repository_is_refused(db: Db) {
    let harness = Harness::start(db).await;
    let result = harness
        .try_create(
            &json!({"name": "gone", "repos": {"app": {"path": "repo", "base": "troupe/deleted"}},
            "tasks": [t("IMPL-1", &[])]}),
        )
        .await;
    assert_code(
        result,
        Code::InvalidArgument,
        "repo `app`: base `troupe/deleted` does not name a commit",
    );
    // Nothing was stored.
    let listed = harness
        .client()
        .list_sessions(troupe_proto::v1::ListSessionsRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert!(listed.sessions.is_empty(), "{:?}", listed.sessions);
    harness.stop().await;
}

db_tests!(
    the_session_branch_starts_at_the_plans_base,
    a_base_missing_from_the_repository_is_refused,
);
