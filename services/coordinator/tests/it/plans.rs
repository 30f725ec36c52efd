//! Session creation: validation, repositories, branches, dry runs, templates.

use serde_json::json;
use tonic::Code;
use troupe_proto::v1::{self as pb, SessionState, TaskState};

use crate::support::{Db, Harness, assert_code, db_tests, session_id, t, task};

async fn create_session_stores_tasks_and_makes_the_session_branch(db: Db) {
    let harness = Harness::start(db).await;
    let created = harness
        .create(
            json!({"name": "quickstart", "description": "demo", "tasks": [
                t("VALIDATE-001", &["IMPL-002"]),
                t("IMPL-002", &["IMPL-001"]),
                t("IMPL-001", &[]),
                t("IMPL-003", &[]),
            ]}),
        )
        .await;
    let session = created.session.clone().expect("session");
    let id = session.id.clone();
    let (prefix, rest) = id.split_at("quickstart-".len());
    assert_eq!(prefix, "quickstart-");
    let (date, hex) = rest.split_once('-').expect("date-hex");
    assert_eq!(date.len(), 8);
    assert!(date.chars().all(|c| c.is_ascii_digit()));
    assert!(
        hex.len() == 6 && hex.chars().all(|c| c.is_ascii_hexdigit()),
        "{id}"
    );
    assert_eq!(session.state(), SessionState::Active);
    assert_eq!(troupe_proto::names::name(session.mode()), "eager");
    assert_eq!(troupe_proto::names::name(session.on_failure()), "skip");

    let counts = session.counts.expect("counts");
    assert_eq!((counts.total, counts.ready, counts.pending), (4, 2, 2));
    let order: Vec<&str> = created.tasks.iter().map(|task| task.id.as_str()).collect();
    assert_eq!(
        order,
        vec!["IMPL-001", "IMPL-003", "IMPL-002", "VALIDATE-001"],
        "topological order"
    );
    assert_eq!(task(&created.tasks, "IMPL-001").state(), TaskState::Ready);
    assert_eq!(task(&created.tasks, "IMPL-003").state(), TaskState::Ready);
    assert_eq!(task(&created.tasks, "IMPL-002").state(), TaskState::Pending);
    assert_eq!(task(&created.tasks, "VALIDATE-001").wave, 3);
    assert_eq!(
        task(&created.tasks, "VALIDATE-001").role(),
        pb::Role::Validator
    );
    let spec = task(&created.tasks, "IMPL-001").spec.clone().expect("spec");
    assert!(spec.fields.contains_key("title"));

    let repo = &session.repos[0];
    assert_eq!(repo.name, "app");
    assert_eq!(repo.base_commit, harness.base_commit);
    assert_eq!(repo.branch, format!("troupe/{id}"));
    let branch_head = troupe_testkit::git(
        std::path::Path::new(&repo.path),
        &["rev-parse", &repo.branch],
    )
    .expect("branch exists");
    assert_eq!(branch_head.trim(), harness.base_commit);

    let listed = harness
        .client()
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert_eq!(listed.sessions.len(), 1);
    assert_eq!(listed.sessions[0].counts.as_ref().expect("counts").total, 4);
    let fetched = harness.session(&id).await;
    assert!(fetched.session.expect("session").last_sequence >= 1 + 4 + 2);
    harness.stop().await;
}

async fn bad_plans_are_refused_with_every_problem_and_nothing_is_stored(db: Db) {
    let harness = Harness::start(db).await;
    let plan = json!({"name": "broken", "repos": {"app": {"path": "repo"}}, "tasks": [
        t("IMPL-001", &["IMPL-404"]),
        t("IMPL-002", &["IMPL-003"]),
        t("IMPL-003", &["IMPL-002"]),
        t("DOC-001", &[]),
        {"id": "IMPL-004", "title": "escape", "files": [{"path": "../../etc/passwd", "action": "modify"}]},
        t("IMPL-001", &[]),
    ]});
    let message = assert_code(
        harness.try_create(&plan).await,
        Code::InvalidArgument,
        "invalid plan",
    );
    for needle in [
        "task IMPL-001 depends on unknown task IMPL-404",
        "dependency cycle: IMPL-002 -> IMPL-003 -> IMPL-002",
        "task DOC-001: unknown role",
        "files[0].path `../../etc/passwd` escapes the repository root",
        "duplicate task id IMPL-001",
    ] {
        assert!(
            message.contains(needle),
            "`{needle}` missing from:\n{message}"
        );
    }
    let malformed = harness
        .client()
        .create_session(pb::CreateSessionRequest {
            plan_json: "{\"name\": \"x\",\n \"tasks\": [}".to_owned(),
            ..Default::default()
        })
        .await;
    assert_code(malformed, Code::InvalidArgument, "malformed json at line 2");

    // A repository that is not a git work tree, and an unknown override, are refused too.
    std::fs::create_dir_all(harness.base_dir.join("not-a-repo")).expect("dir");
    let plan = json!({"name": "norepo", "repos": {"app": {"path": "not-a-repo"}}, "tasks": [t("IMPL-1", &[])]});
    assert_code(
        harness.try_create(&plan).await,
        Code::InvalidArgument,
        "is not a git repository",
    );

    let listed = harness
        .client()
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert!(listed.sessions.is_empty(), "{:?}", listed.sessions);
    let branches = troupe_testkit::git(
        &harness.base_dir.join("repo"),
        &["branch", "--list", "troupe/*"],
    )
    .expect("git branch");
    assert!(branches.trim().is_empty(), "{branches}");
    harness.stop().await;
}

async fn dry_run_validates_and_stores_nothing(db: Db) {
    let harness = Harness::start(db).await;
    let response = harness
        .client()
        .create_session(pb::CreateSessionRequest {
            plan_json: json!({"name": "dry", "repos": {"app": {"path": "repo"}}, "tasks": [t("IMPL-1", &[]), t("IMPL-2", &["IMPL-1"])]}).to_string(),
            base_dir: harness.base_dir.display().to_string(),
            dry_run: true,
            ..Default::default()
        })
        .await
        .expect("dry run")
        .into_inner();
    let session = response.session.expect("session");
    assert!(session.id.is_empty());
    assert_eq!(session.repos[0].base_commit, harness.base_commit);
    assert_eq!(task(&response.tasks, "IMPL-1").state(), TaskState::Ready);
    assert_eq!(task(&response.tasks, "IMPL-2").state(), TaskState::Pending);
    let listed = harness
        .client()
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert!(listed.sessions.is_empty());
    harness.stop().await;
}

async fn template_repo_is_imported_once_and_reused(db: Db) {
    let harness = Harness::start(db).await;
    let plan = json!({"name": "tmpl", "repos": {"web": {"template": "sample"}}, "tasks": [t("IMPL-1", &[])]});
    let first = harness.create(plan.clone()).await;
    let second = harness.create(plan).await;
    let repo_a = &first.session.as_ref().expect("session").repos[0];
    let repo_b = &second.session.as_ref().expect("session").repos[0];
    assert_eq!(repo_a.path, repo_b.path);
    assert_eq!(repo_a.base_commit, repo_b.base_commit);
    let expected = harness
        .dir
        .path()
        .join("data/repos/tmpl/web")
        .canonicalize()
        .expect("template copy");
    assert_eq!(std::path::Path::new(&repo_a.path), expected);
    assert!(expected.join("src/app.py").is_file());
    let files = troupe_testkit::git(&expected, &["ls-files"]).expect("ls-files");
    assert!(files.contains("src/app.py"), "{files}");
    assert_ne!(session_id(&first), session_id(&second));
    harness.stop().await;
}

async fn repo_paths_override_the_default_repo(db: Db) {
    let harness = Harness::start(db).await;
    let other = harness.dir.path().join("other");
    let other_head = troupe_testkit::git_repo(&other, &[("x.txt", "x\n")]).expect("repo");
    let response = harness
        .client()
        .create_session(pb::CreateSessionRequest {
            plan_json: json!({"name": "override", "repos": {"app": {"path": "missing"}}, "tasks": [t("IMPL-1", &[])]}).to_string(),
            base_dir: harness.base_dir.display().to_string(),
            repo_paths: [(String::new(), other.display().to_string())].into_iter().collect(),
            ..Default::default()
        })
        .await
        .expect("create")
        .into_inner();
    assert_eq!(
        response.session.expect("session").repos[0].base_commit,
        other_head
    );
    harness.stop().await;
}

/// An EXEC phase's task files are read at intake, from the plan's files when it sends them,
/// else from its base directory, and stored in the EXEC task as `phase_tasks` with the plan's
/// execution hints; a bad phase is refused with every problem, and nothing is stored.
async fn exec_phases_are_checked_and_stored_at_intake(db: Db) {
    let harness = Harness::start(db).await;
    let phase = harness.base_dir.join("phase-1/.task");
    std::fs::create_dir_all(&phase).expect("phase dir");
    let write = |id: &str, deps: &[&str]| {
        std::fs::write(phase.join(format!("{id}.json")), t(id, deps).to_string())
            .expect("task file")
    };
    write("IMPL-101", &[]);
    write("IMPL-102", &["IMPL-103"]);
    write("IMPL-103", &["IMPL-102"]);
    std::fs::write(phase.join("notes.md"), "not a task").expect("notes");
    let plan = json!({"name": "phased", "recommended_execution": "Agent", "repos": {"app": {"path": "repo"}}, "tasks": [
        {"id": "EXEC-1", "title": "phase 1", "phase": 1},
        {"id": "EXEC-2", "title": "phase 2", "phase": 2},
        {"id": "EXEC-3", "title": "elsewhere", "phase": "../up"},
    ]});
    let message = assert_code(
        harness.try_create(&plan).await,
        Code::InvalidArgument,
        "invalid plan",
    );
    for needle in [
        "task EXEC-1: `phase_tasks`: dependency cycle: IMPL-102 -> IMPL-103 -> IMPL-102",
        "task EXEC-2: phase `phase-2`: cannot read",
        "task EXEC-3: phase directory `../up` must stay inside the plan directory",
    ] {
        assert!(
            message.contains(needle),
            "`{needle}` missing from:\n{message}"
        );
    }
    let listed = harness
        .client()
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert!(listed.sessions.is_empty(), "{:?}", listed.sessions);

    // Fixed on disk: read from the base directory.
    write("IMPL-103", &["IMPL-101"]);
    let plan = json!({"name": "phased", "recommended_execution": "Agent", "repos": {"app": {"path": "repo"}}, "tasks": [
        {"id": "EXEC-1", "title": "phase 1", "phase": 1},
        t("VALIDATE-1", &["EXEC-1"]),
    ]});
    let created = harness.try_create(&plan).await.expect("created");
    let spec = crate::support::spec_json(task(&created.tasks, "EXEC-1"));
    let ids: Vec<&str> = spec["phase_tasks"]
        .as_array()
        .expect("phase_tasks")
        .iter()
        .map(|task| task["id"].as_str().expect("id"))
        .collect();
    assert_eq!(ids, ["IMPL-101", "IMPL-102", "IMPL-103"]);
    assert_eq!(
        spec["plan_hints"],
        json!({"recommended_execution": "Agent"})
    );
    let validate = crate::support::spec_json(task(&created.tasks, "VALIDATE-1"));
    assert!(validate.get("plan_hints").is_none(), "{validate}");

    // Sent as plan assets, they are read from there, not from the base directory.
    let asset = |path: &str, task: serde_json::Value| pb::PlanAsset {
        path: path.to_owned(),
        content: task.to_string().into_bytes(),
        executable: false,
    };
    let created = harness
        .client()
        .create_session(pb::CreateSessionRequest {
            plan_json: plan.to_string(),
            base_dir: harness.base_dir.display().to_string(),
            assets: vec![
                asset("phase-1/.task/IMPL-201.json", t("IMPL-201", &[])),
                asset("phase-1/.task/sub/IMPL-9.json", t("IMPL-9", &[])),
            ],
            ..Default::default()
        })
        .await
        .expect("created from assets")
        .into_inner();
    let spec = crate::support::spec_json(task(&created.tasks, "EXEC-1"));
    assert_eq!(spec["phase_tasks"], json!([t("IMPL-201", &[])]));
    harness.stop().await;
}

db_tests!(
    create_session_stores_tasks_and_makes_the_session_branch,
    bad_plans_are_refused_with_every_problem_and_nothing_is_stored,
    dry_run_validates_and_stores_nothing,
    template_repo_is_imported_once_and_reused,
    repo_paths_override_the_default_repo,
    exec_phases_are_checked_and_stored_at_intake,
);
