//! Landlock confinement against the real kernel: a confined `bash` child tries to leave its
//! worktree, and the kernel says no; the same child unconfined gets through.

use std::path::Path;

use tokio_util::sync::CancellationToken;
use troupe_process::{Command, Output, Sandbox, SandboxMode};

struct Layout {
    _root: tempfile::TempDir,
    data: std::path::PathBuf,
    worktree: std::path::PathBuf,
    home: std::path::PathBuf,
    other: std::path::PathBuf,
    store: std::path::PathBuf,
}

/// A data dir with this task's worktree and home, another task's worktree and a store file.
fn layout() -> Layout {
    let root = tempfile::tempdir().expect("tempdir");
    let data = root.path().join("data");
    let worktree = data.join("worktrees/t1");
    let home = data.join("attempts/t1/home");
    let other = data.join("worktrees/t2");
    for dir in [&worktree, &home, &other] {
        std::fs::create_dir_all(dir).expect("mkdir");
    }
    std::fs::write(other.join("secret.txt"), "other task").expect("write");
    let store = data.join("coordinator.db");
    std::fs::write(&store, "SQLite format 3").expect("write");
    Layout {
        _root: root,
        data,
        worktree,
        home,
        other,
        store,
    }
}

fn sandbox(l: &Layout) -> Sandbox {
    Sandbox::new(SandboxMode::Enforce)
        .protect(&l.data)
        .write(&l.worktree)
        .write(&l.home)
}

async fn bash(l: &Layout, sandbox: Option<Sandbox>, script: &str) -> Output {
    let mut cmd = Command::new("bash")
        .args(["-c", script])
        .cwd(&l.worktree)
        .env("HOME", l.home.display().to_string());
    if let Some(sandbox) = sandbox {
        cmd = cmd.sandbox(sandbox);
    }
    cmd.run(&CancellationToken::new()).await.expect("runs")
}

fn landlock() -> bool {
    let abi = troupe_process::sandbox::landlock_abi();
    assert!(
        abi.is_some() || std::env::var_os("CI").is_none(),
        "this machine's kernel has Landlock; CI must too"
    );
    abi.is_some()
}

#[tokio::test]
async fn the_worktree_is_writable_and_everything_else_denied() {
    if !landlock() {
        return;
    }
    let l = layout();
    let outside = l.data.join("escaped");
    let ok = bash(
        &l,
        Some(sandbox(&l)),
        "echo hi > inside.txt && cat inside.txt && echo h > \"$HOME/h\" && ls /usr/bin >/dev/null",
    )
    .await;
    assert!(ok.success(), "{}", ok.stderr_text());
    assert_eq!(ok.stdout_text(), "hi\n");

    let cases = [
        (
            format!("echo x > {}", outside.display()),
            outside.display().to_string(),
        ),
        (
            format!("cat {}", l.store.display()),
            l.store.display().to_string(),
        ),
        (
            "cat ../t2/secret.txt".to_owned(),
            "../t2/secret.txt".to_owned(),
        ),
        (
            format!("ls {}", l.other.display()),
            l.other.display().to_string(),
        ),
    ];
    for (script, named) in cases {
        let out = bash(&l, Some(sandbox(&l)), &script).await;
        assert!(!out.success(), "{script} succeeded: {}", out.stdout_text());
        let stderr = out.stderr_text();
        assert!(stderr.contains("Permission denied"), "{script}: {stderr}");
        assert_eq!(
            sandbox(&l).denied(&stderr, Some(&l.worktree)).as_deref(),
            Some(named.as_str()),
            "{script}: {stderr}"
        );
    }
    assert!(!outside.exists(), "the denied write landed");

    // The same script unconfined gets through: the denials were the sandbox's.
    let free = bash(&l, None, &format!("cat {}", l.store.display())).await;
    assert!(free.success(), "{}", free.stderr_text());
}

#[tokio::test]
async fn a_symlink_out_of_the_worktree_is_denied() {
    if !landlock() {
        return;
    }
    let l = layout();
    std::os::unix::fs::symlink(&l.store, l.worktree.join("link")).expect("symlink");
    let out = bash(&l, Some(sandbox(&l)), "cat link").await;
    assert!(!out.success());
    let expected = format!("link -> {}", l.store.display());
    assert_eq!(
        sandbox(&l)
            .denied(&out.stderr_text(), Some(&l.worktree))
            .as_deref(),
        Some(expected.as_str()),
        "{}",
        out.stderr_text()
    );
}

#[tokio::test]
async fn tcp_connects_only_to_allowed_ports() {
    if troupe_process::sandbox::landlock_abi().unwrap_or(0) < 4 {
        assert!(std::env::var_os("CI").is_none(), "CI needs Landlock ABI 4");
        return;
    }
    let l = layout();
    let allowed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let denied = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let (allowed, denied) = (
        allowed.local_addr().expect("addr").port(),
        denied.local_addr().expect("addr").port(),
    );
    let net = || sandbox(&l).connect_ports(Some([allowed]));
    let ok = bash(
        &l,
        Some(net()),
        &format!("exec 3<>/dev/tcp/127.0.0.1/{allowed}"),
    )
    .await;
    assert!(ok.success(), "{}", ok.stderr_text());
    let out = bash(
        &l,
        Some(net()),
        &format!("exec 3<>/dev/tcp/127.0.0.1/{denied}"),
    )
    .await;
    assert!(!out.success());
    let expected = format!("tcp port {denied}");
    assert_eq!(
        net()
            .denied(&out.stderr_text(), Some(&l.worktree))
            .as_deref(),
        Some(expected.as_str()),
        "{}",
        out.stderr_text()
    );
}

#[tokio::test]
async fn a_path_covering_a_protected_one_is_not_granted() {
    if !landlock() {
        return;
    }
    let l = layout();
    // Granting the data dir's parent would expose the store: the grant is dropped.
    let parent = l.data.parent().expect("parent").to_path_buf();
    let out = bash(
        &l,
        Some(sandbox(&l).read(&parent)),
        &format!("cat {}", l.store.display()),
    )
    .await;
    assert!(!out.success(), "{}", out.stdout_text());
    assert!(Path::new(&l.store).exists());
}

#[tokio::test]
async fn off_and_warn_modes() {
    let l = layout();
    let off = bash(
        &l,
        Some(Sandbox::off()),
        &format!("cat {}", l.store.display()),
    )
    .await;
    assert!(off.success(), "{}", off.stderr_text());
    if landlock() {
        // Warn still confines where the kernel can.
        let warn = bash(
            &l,
            Some(sandbox(&l).with_mode(SandboxMode::Warn)),
            &format!("cat {}", l.store.display()),
        )
        .await;
        assert!(!warn.success());
    }
}
