//! Authentication through real sockets: a real tonic server behind `serve()`'s auth layer,
//! real token files rewritten under it, real TLS handshakes with certificates made here.
//!
//! No business service is mounted, so a request the layer lets through is answered
//! UNIMPLEMENTED by the router: that code is how these tests see "authorized". The services
//! themselves are exercised with credentials in the end-to-end tests.

use std::path::{Path, PathBuf};

use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;
use troupe_grpc::auth::{Access, Credentials, Reflection, Security, ServerAuth};
use troupe_grpc::{Connector, ServeOptions, Services};
use troupe_proto::v1::{ClaimTasksRequest, CreateSessionRequest};
use troupe_testkit::eventually;
use troupe_testkit::pki::Pki;

const WORKER: &str = "worker-token-0123456789abcdef";
const CLIENT: &str = "client-token-0123456789abcdef";
const ADMIN: &str = "admin-token-0123456789abcdef";

struct Server {
    addr: std::net::SocketAddr,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), troupe_grpc::Error>>,
}

impl Server {
    async fn start(security: &Security) -> Self {
        let auth = ServerAuth::load(security)
            .await
            .expect("auth settings load");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let stop = CancellationToken::new();
        let task = tokio::spawn(troupe_grpc::serve(
            listener,
            Services::new(),
            stop.clone(),
            ServeOptions::with_auth(auth),
        ));
        Self { addr, stop, task }
    }

    fn url(&self, scheme: &str) -> String {
        format!("{scheme}://{}", self.addr)
    }

    async fn stop(self) {
        self.stop.cancel();
        self.task.await.expect("server task").expect("server");
    }
}

fn write(path: &Path, text: &str) -> PathBuf {
    std::fs::write(path, text).expect("write");
    path.to_path_buf()
}

fn token_file(dir: &Path) -> PathBuf {
    write(
        &dir.join("tokens"),
        &format!("# scopes:token\nworker:{WORKER}\nclient:{CLIENT}\nadmin:{ADMIN}\n"),
    )
}

async fn connector_with_token(dir: &Path, name: &str, token: &str) -> Connector {
    let path = write(&dir.join(name), &format!("{token}\n"));
    Connector::new(&Credentials {
        token_file: Some(path),
        ..Credentials::default()
    })
    .await
    .expect("connector")
}

/// The codes of `ClaimTasks` (worker) and `CreateSession` (client) for `connector`.
async fn codes(connector: &Connector, url: &str) -> (Code, Code) {
    let mut client = connector.coordinator_client(url).expect("client");
    let claim = client
        .claim_tasks(ClaimTasksRequest::default())
        .await
        .expect_err("no coordinator is mounted")
        .code();
    let create = client
        .create_session(CreateSessionRequest::default())
        .await
        .expect_err("no coordinator is mounted")
        .code();
    (claim, create)
}

async fn health(connector: &Connector, url: &str) -> Result<i32, tonic::Status> {
    let channel = connector.channel(url).expect("channel");
    HealthClient::new(channel)
        .check(HealthCheckRequest::default())
        .await
        .map(|response| response.into_inner().status)
}

#[tokio::test]
async fn each_token_reaches_its_scopes_only_and_health_stays_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    let security = Security {
        access: Access {
            auth_tokens_file: Some(token_file(dir.path())),
            ..Access::default()
        },
        ..Security::default()
    };
    let server = Server::start(&security).await;
    let url = server.url("http");

    let anonymous = Connector::default();
    assert_eq!(
        codes(&anonymous, &url).await,
        (Code::Unauthenticated, Code::Unauthenticated)
    );
    assert_eq!(health(&anonymous, &url).await.expect("health is open"), 1);

    let stranger = connector_with_token(dir.path(), "stranger", "unknown-token-0123456789").await;
    assert_eq!(
        codes(&stranger, &url).await,
        (Code::Unauthenticated, Code::Unauthenticated)
    );
    let worker = connector_with_token(dir.path(), "worker", WORKER).await;
    assert_eq!(
        codes(&worker, &url).await,
        (Code::Unimplemented, Code::PermissionDenied)
    );
    let client = connector_with_token(dir.path(), "client", CLIENT).await;
    assert_eq!(
        codes(&client, &url).await,
        (Code::PermissionDenied, Code::Unimplemented)
    );
    let admin = connector_with_token(dir.path(), "admin", ADMIN).await;
    assert_eq!(
        codes(&admin, &url).await,
        (Code::Unimplemented, Code::Unimplemented)
    );

    // The refusal names the caller by fingerprint, never by the token itself.
    let refused = worker
        .coordinator_client(&url)
        .expect("client")
        .create_session(CreateSessionRequest::default())
        .await
        .expect_err("refused");
    assert!(
        refused.message().contains("token sha256:")
            && refused.message().contains("needs client or admin")
            && !refused.message().contains(WORKER),
        "{refused:?}"
    );
    server.stop().await;
}

#[tokio::test]
async fn a_rewritten_token_file_takes_effect_without_a_restart_on_both_sides() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tokens = token_file(dir.path());
    let security = Security {
        access: Access {
            auth_tokens_file: Some(tokens.clone()),
            ..Access::default()
        },
        ..Security::default()
    };
    let server = Server::start(&security).await;
    let url = server.url("http");
    let worker = connector_with_token(dir.path(), "worker", WORKER).await;
    assert_eq!(codes(&worker, &url).await.0, Code::Unimplemented);

    // Rotate: the server accepts only the new worker token...
    let rotated = "rotated-worker-token-0123456789";
    write(&tokens, &format!("worker:{rotated}\nclient:{CLIENT}\n"));
    eventually("the old token to be refused", || async {
        (codes(&worker, &url).await.0 == Code::Unauthenticated).then_some(())
    })
    .await;
    // ...and the worker, whose token file is rewritten too, sends it without a restart.
    write(&dir.path().join("worker"), &format!("{rotated}\n"));
    eventually("the worker to send the new token", || async {
        (codes(&worker, &url).await.0 == Code::Unimplemented).then_some(())
    })
    .await;

    server.stop().await;
}

/// Log lines of this thread's subscriber (the tests' runtime runs every task on it).
#[derive(Clone, Default)]
struct Logs(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log buffer").extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("log buffer")).into_owned()
    }
}

#[tokio::test]
async fn a_broken_token_file_keeps_the_last_good_tokens_and_never_logs_one() {
    let logs = Logs::default();
    let writer = logs.clone();
    let _guard = tracing::subscriber::set_default(
        tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish(),
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let tokens = token_file(dir.path());
    let security = Security {
        access: Access {
            auth_tokens_file: Some(tokens.clone()),
            ..Access::default()
        },
        ..Security::default()
    };
    let server = Server::start(&security).await;
    let url = server.url("http");
    let client = connector_with_token(dir.path(), "client", CLIENT).await;
    assert_eq!(codes(&client, &url).await.1, Code::Unimplemented);

    // Parsed, this file would drop the client token; it does not parse (too short a token).
    let broken = "worker:short-secret";
    write(&tokens, &format!("{broken}\n"));
    eventually("the broken file to be read", || async {
        logs.text()
            .contains("credentials file invalid")
            .then_some(())
    })
    .await;
    assert_eq!(codes(&client, &url).await.1, Code::Unimplemented);
    // A refused caller is logged by fingerprint; no token appears in any log line.
    let stranger = connector_with_token(dir.path(), "stranger", "unknown-token-0123456789").await;
    assert_eq!(codes(&stranger, &url).await.0, Code::Unauthenticated);
    server.stop().await;
    let text = logs.text();
    assert!(text.contains("request refused"), "{text}");
    for secret in [WORKER, CLIENT, ADMIN, broken, "unknown-token-0123456789"] {
        assert!(
            !text.contains(secret),
            "a token leaked into the logs:\n{text}"
        );
    }
}

#[tokio::test]
async fn sighup_reloads_a_token_file_the_watch_does_not_see() {
    let dir = tempfile::tempdir().expect("tempdir");
    let elsewhere = dir.path().join("elsewhere");
    let mounted = dir.path().join("mounted");
    std::fs::create_dir_all(&elsewhere).expect("mkdir");
    std::fs::create_dir_all(&mounted).expect("mkdir");
    // The configured path is a symlink into another directory: writes there raise no event
    // in the watched directory, so only SIGHUP tells the server.
    let target = token_file(&elsewhere);
    let link = mounted.join("tokens");
    std::os::unix::fs::symlink(&target, &link).expect("symlink");
    let security = Security {
        access: Access {
            auth_tokens_file: Some(link),
            ..Access::default()
        },
        ..Security::default()
    };
    let server = Server::start(&security).await;
    let url = server.url("http");
    let added = "added-by-sighup-0123456789";
    write(&target, &format!("worker:{WORKER}\nclient:{added}\n"));
    let newcomer = connector_with_token(dir.path(), "newcomer", added).await;
    nix::sys::signal::raise(nix::sys::signal::Signal::SIGHUP).expect("raise SIGHUP");
    eventually("SIGHUP to load the new token", || async {
        (codes(&newcomer, &url).await.1 == Code::Unimplemented).then_some(())
    })
    .await;
    server.stop().await;
}

#[tokio::test]
async fn client_certificates_carry_their_scopes_in_o() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = Pki::new(dir.path(), "ca").expect("ca");
    let server_pair = pki
        .server("server", &["localhost", "127.0.0.1"], None)
        .expect("server cert");
    let security = Security {
        access: Access {
            tls_client_ca: Some(pki.ca_cert.clone()),
            ..Access::default()
        },
        credentials: Credentials {
            tls_cert: Some(server_pair.cert.clone()),
            tls_key: Some(server_pair.key.clone()),
            ..Credentials::default()
        },
    };
    let server = Server::start(&security).await;
    let url = server.url("https");
    let with_cert = |organization: Option<&'static str>, name: &'static str| {
        let pki = &pki;
        async move {
            let pair = pki.client(name, organization).expect("client cert");
            Connector::new(&Credentials {
                tls_ca: Some(pki.ca_cert.clone()),
                tls_cert: Some(pair.cert),
                tls_key: Some(pair.key),
                ..Credentials::default()
            })
            .await
            .expect("connector")
        }
    };
    assert_eq!(
        codes(&with_cert(Some("worker"), "executor-1").await, &url).await,
        (Code::Unimplemented, Code::PermissionDenied)
    );
    assert_eq!(
        codes(&with_cert(Some("client"), "alice").await, &url).await,
        (Code::PermissionDenied, Code::Unimplemented)
    );
    assert_eq!(
        codes(&with_cert(Some("admin"), "root").await, &url).await,
        (Code::Unimplemented, Code::Unimplemented)
    );
    let no_scope = with_cert(Some("acme"), "mallory").await;
    let refused = no_scope
        .coordinator_client(&url)
        .expect("client")
        .claim_tasks(ClaimTasksRequest::default())
        .await
        .expect_err("refused");
    assert_eq!(refused.code(), Code::PermissionDenied);
    assert!(
        refused.message().contains("certificate CN=mallory"),
        "{refused:?}"
    );

    // Without a certificate (and no tokens accepted) the handshake itself is refused, and
    // a certificate from another CA likewise.
    let only_ca = Connector::new(&Credentials {
        tls_ca: Some(pki.ca_cert.clone()),
        ..Credentials::default()
    })
    .await
    .expect("connector");
    assert!(health(&only_ca, &url).await.is_err());
    let other_dir = dir.path().join("other");
    std::fs::create_dir_all(&other_dir).expect("mkdir");
    let other = Pki::new(&other_dir, "other-ca").expect("ca");
    let foreign = other.client("foreign", Some("admin")).expect("cert");
    let foreigner = Connector::new(&Credentials {
        tls_ca: Some(pki.ca_cert.clone()),
        tls_cert: Some(foreign.cert),
        tls_key: Some(foreign.key),
        ..Credentials::default()
    })
    .await
    .expect("connector");
    assert!(health(&foreigner, &url).await.is_err());
    // Plaintext to a TLS server gets nowhere.
    assert!(
        health(&Connector::default(), &server.url("http"))
            .await
            .is_err()
    );
    // An https URL without a CA is refused before any connection.
    let err = Connector::default()
        .channel(&url)
        .expect_err("https needs a CA");
    assert!(err.to_string().contains("--tls-ca"), "{err}");
    server.stop().await;
}

#[tokio::test]
async fn with_tokens_and_a_client_ca_either_credential_works_over_tls() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = Pki::new(dir.path(), "ca").expect("ca");
    let server_pair = pki.server("server", &["127.0.0.1"], None).expect("cert");
    let health_addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port");
    let security = Security {
        access: Access {
            tls_client_ca: Some(pki.ca_cert.clone()),
            auth_tokens_file: Some(token_file(dir.path())),
            health_listen: Some(health_addr),
            ..Access::default()
        },
        credentials: Credentials {
            tls_cert: Some(server_pair.cert.clone()),
            tls_key: Some(server_pair.key.clone()),
            ..Credentials::default()
        },
    };
    let server = Server::start(&security).await;
    let url = server.url("https");
    let token_only = Connector::new(&Credentials {
        tls_ca: Some(pki.ca_cert.clone()),
        token_file: Some(write(&dir.path().join("client"), CLIENT)),
        ..Credentials::default()
    })
    .await
    .expect("connector");
    assert_eq!(codes(&token_only, &url).await.1, Code::Unimplemented);
    let anonymous = Connector::new(&Credentials {
        tls_ca: Some(pki.ca_cert.clone()),
        ..Credentials::default()
    })
    .await
    .expect("connector");
    assert_eq!(health(&anonymous, &url).await.expect("health is open"), 1);
    assert_eq!(
        codes(&anonymous, &url).await,
        (Code::Unauthenticated, Code::Unauthenticated)
    );
    // The health-only listener answers plaintext probes, and nothing else.
    let probe_url = format!("http://{health_addr}");
    assert_eq!(
        health(&Connector::default(), &probe_url)
            .await
            .expect("plaintext health"),
        1
    );
    let admin = connector_with_token(dir.path(), "admin", ADMIN).await;
    assert_eq!(
        codes(&admin, &probe_url).await,
        (Code::Unimplemented, Code::Unimplemented)
    );
    server.stop().await;
}

#[tokio::test]
async fn reflection_is_open_by_default_and_can_need_credentials_or_be_off() {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;

    async fn list(connector: &Connector, url: &str) -> Result<(), Code> {
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let channel = connector.channel(url).expect("channel");
        let mut client = ServerReflectionClient::with_interceptor(
            channel,
            connector.outbound(std::time::Duration::from_secs(10)),
        );
        let mut stream = client
            .server_reflection_info(tokio_stream::iter([request]))
            .await
            .map_err(|status| status.code())?
            .into_inner();
        stream.message().await.map_err(|status| status.code())?;
        Ok(())
    }

    let dir = tempfile::tempdir().expect("tempdir");
    let admin = connector_with_token(dir.path(), "admin", ADMIN).await;
    let anonymous = Connector::default();
    for (reflection, anonymous_gets, admin_gets) in [
        (Reflection::Open, Ok(()), Ok(())),
        (
            Reflection::Authenticated,
            Err(Code::Unauthenticated),
            Ok(()),
        ),
        (
            Reflection::Off,
            Err(Code::Unauthenticated),
            Err(Code::Unimplemented),
        ),
    ] {
        let security = Security {
            access: Access {
                auth_tokens_file: Some(token_file(dir.path())),
                reflection,
                ..Access::default()
            },
            ..Security::default()
        };
        let server = Server::start(&security).await;
        let url = server.url("http");
        assert_eq!(
            list(&anonymous, &url).await,
            anonymous_gets,
            "{reflection:?}"
        );
        assert_eq!(list(&admin, &url).await, admin_gets, "{reflection:?}");
        server.stop().await;
    }
}

#[tokio::test]
async fn a_non_loopback_listener_needs_authentication_or_insecure() {
    let serve = |security: Security| async move {
        let auth = ServerAuth::load(&security).await?;
        let listener = tokio::net::TcpListener::bind("0.0.0.0:0")
            .await
            .expect("bind");
        let stop = CancellationToken::new();
        stop.cancel();
        troupe_grpc::serve(
            listener,
            Services::new(),
            stop,
            ServeOptions::with_auth(auth),
        )
        .await
    };
    let err = serve(Security::default())
        .await
        .expect_err("refused without auth");
    let message = err.to_string();
    assert!(
        message.contains("refusing to serve on 0.0.0.0:")
            && message.contains("--insecure")
            && message.contains("--auth-tokens-file"),
        "{message}"
    );
    serve(Security {
        access: Access {
            insecure: true,
            ..Access::default()
        },
        ..Security::default()
    })
    .await
    .expect("insecure serves");
    serve(Security {
        access: Access {
            auth_tokens: Some(format!("admin:{ADMIN}")),
            ..Access::default()
        },
        ..Security::default()
    })
    .await
    .expect("tokens from the environment are authentication");
}

#[tokio::test]
async fn bad_settings_are_refused_with_the_file_and_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = write(
        &dir.path().join("tokens"),
        &format!("worker:{WORKER}\nboss:{ADMIN}\n"),
    );
    let err = ServerAuth::load(&Security {
        access: Access {
            auth_tokens_file: Some(bad.clone()),
            ..Access::default()
        },
        ..Security::default()
    })
    .await
    .expect_err("unknown scope");
    let message = err.to_string();
    assert!(
        message.contains(&format!("{}:2: unknown scope `boss`", bad.display()))
            && !message.contains(ADMIN),
        "{message}"
    );
    let err = ServerAuth::load(&Security {
        access: Access {
            tls_client_ca: Some(bad),
            ..Access::default()
        },
        ..Security::default()
    })
    .await
    .expect_err("client CA without a server certificate");
    assert!(err.to_string().contains("--tls-cert"), "{err}");
    let err = ServerAuth::load(&Security {
        credentials: Credentials {
            tls_cert: Some(dir.path().join("missing.pem")),
            tls_key: Some(dir.path().join("missing-key.pem")),
            ..Credentials::default()
        },
        ..Security::default()
    })
    .await
    .expect_err("missing certificate");
    assert!(err.to_string().contains("missing.pem"), "{err}");
}

#[tokio::test]
async fn debug_output_never_shows_a_token_or_a_private_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = Pki::new(dir.path(), "ca").expect("ca");
    let pair = pki
        .server("server", &["127.0.0.1"], Some("worker"))
        .expect("cert");
    let key_pem = std::fs::read_to_string(&pair.key).expect("key");
    let key_line = key_pem.lines().nth(1).expect("a key line").to_owned();
    let security = Security {
        access: Access {
            auth_tokens_file: Some(token_file(dir.path())),
            auth_tokens: Some(format!("admin:{ADMIN}")),
            tls_client_ca: Some(pki.ca_cert.clone()),
            ..Access::default()
        },
        credentials: Credentials {
            tls_ca: Some(pki.ca_cert.clone()),
            tls_cert: Some(pair.cert.clone()),
            tls_key: Some(pair.key.clone()),
            token_file: Some(write(&dir.path().join("mine"), WORKER)),
            max_message_bytes: None,
        },
    };
    let auth = ServerAuth::load(&security).await.expect("auth");
    let connector = Connector::new(&security.credentials)
        .await
        .expect("connector");
    let shown = format!(
        "{security:?} {auth:?} {connector:?} {:?}",
        connector.outbound(std::time::Duration::from_secs(1))
    );
    for secret in [WORKER, CLIENT, ADMIN, key_line.as_str()] {
        assert!(
            !shown.contains(secret),
            "a secret in Debug output:\n{shown}"
        );
    }
    // Key bytes would show as a list of numbers.
    let key_der = key_der(&key_pem);
    assert!(
        !shown.contains(&format!("{:?}", &key_der[..8])),
        "key bytes in Debug output:\n{shown}"
    );
}

/// The DER bytes of a PEM private key.
fn key_der(pem: &str) -> Vec<u8> {
    use rustls::pki_types::PrivateKeyDer;
    use rustls::pki_types::pem::PemObject;
    PrivateKeyDer::from_pem_slice(pem.as_bytes())
        .expect("a key")
        .secret_der()
        .to_vec()
}
