//! Who may call what: bearer tokens and mutual TLS on every business RPC.
//!
//! A server built with [`Access`] (which tokens and client certificates it accepts) checks
//! every request once, in a tower layer [`crate::serve`] puts in front of all services: the
//! RPC's [`policy`] says which [`Scope`]s may call it; the caller proves its scopes with an
//! `authorization: Bearer <token>` header (tokens from a file that is reloaded on change and on
//! SIGHUP, and from the environment) or with a client certificate signed by the configured
//! client CA, whose subject Organization (`O=`) entries name its scopes (as Kubernetes reads
//! groups from `O=`). Missing or unknown credentials get UNAUTHENTICATED; a known caller
//! without the scope gets PERMISSION_DENIED. Health is always open; reflection is open, needs
//! credentials, or is off ([`Reflection`]).
//!
//! A client built with [`Credentials`] (a token file, the CA it trusts, its own certificate)
//! sends them on every call: see [`crate::Connector`]. Tokens never appear in logs, errors
//! or `Debug` output; a token is named by a short SHA-256 fingerprint instead.

mod layer;
pub mod policy;
mod tls;
mod tokens;

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

pub(crate) use layer::AuthLayer;
pub use layer::authorize_as;
pub(crate) use tls::{ClientTls, ServerTls, peer_principal};
pub use tokens::{Principal, Token};
pub(crate) use tokens::{TokenSet, TokenSource, Watched};

use crate::Error;

/// A permission a caller holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scope {
    /// The worker protocol: claim, heartbeat, complete, fail, messages and state, and the
    /// calls workers make on each other (the executor's `Validate`).
    Worker,
    /// Sessions, watching, messages, state, check/resume/pause/cancel, and the direct RPCs
    /// (`ExecuteTask`, `Validate`, `RunTests`, `ListBackends`).
    Client,
    /// Everything.
    Admin,
}

impl Scope {
    /// Every scope, in the order they print.
    pub const ALL: [Scope; 3] = [Scope::Worker, Scope::Client, Scope::Admin];

    /// The scope's name as token files and certificates spell it.
    pub fn name(self) -> &'static str {
        match self {
            Scope::Worker => "worker",
            Scope::Client => "client",
            Scope::Admin => "admin",
        }
    }

    /// The scope named `name`, if it is one.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|scope| scope.name() == name)
    }

    fn bit(self) -> u8 {
        match self {
            Scope::Worker => 1,
            Scope::Client => 2,
            Scope::Admin => 4,
        }
    }
}

/// A set of [`Scope`]s.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Scopes(u8);

impl Scopes {
    /// No scope at all.
    pub const NONE: Scopes = Scopes(0);

    /// The set holding `scopes`.
    pub fn of(scopes: &[Scope]) -> Self {
        Self(scopes.iter().fold(0, |bits, scope| bits | scope.bit()))
    }

    /// Whether `scope` is in the set.
    pub fn contains(self, scope: Scope) -> bool {
        self.0 & scope.bit() != 0
    }

    /// Whether the set shares a scope with `other`.
    pub fn intersects(self, other: Scopes) -> bool {
        self.0 & other.0 != 0
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Adds `scope`.
    pub fn insert(&mut self, scope: Scope) {
        self.0 |= scope.bit();
    }

    /// The scopes in the set.
    pub fn iter(self) -> impl Iterator<Item = Scope> {
        Scope::ALL
            .into_iter()
            .filter(move |scope| self.contains(*scope))
    }
}

impl fmt::Display for Scopes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("no scope");
        }
        let names: Vec<&str> = self.iter().map(Scope::name).collect();
        f.write_str(&names.join(","))
    }
}

impl fmt::Debug for Scopes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Scopes({self})")
    }
}

/// Whether server reflection is served, and to whom.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Reflection {
    /// Anyone may list and describe the services (grpcurl needs no proto files).
    #[default]
    Open,
    /// Only callers with valid credentials (any scope).
    Authenticated,
    /// Not served.
    Off,
}

/// What a server accepts, from flags or `TROUPE_*` variables.
#[derive(Clone, Default, clap::Args)]
pub struct Access {
    /// File of accepted bearer tokens, one `<scopes>:<token>` per line (scopes: `worker`,
    /// `client`, `admin`, comma-separated; `#` starts a comment). Reloaded when it changes
    /// and on SIGHUP; a file that fails to parse leaves the previous tokens in force.
    #[arg(long, env = "TROUPE_AUTH_TOKENS_FILE", value_name = "FILE")]
    pub auth_tokens_file: Option<PathBuf>,
    /// Accepted bearer tokens as `<scopes>:<token>` entries separated by whitespace. Prefer
    /// the variable or the file: a flag's value is visible in the process list.
    #[arg(
        long,
        env = "TROUPE_AUTH_TOKENS",
        value_name = "ENTRIES",
        hide_env_values = true
    )]
    pub auth_tokens: Option<String>,
    /// CA certificate (PEM) that client certificates must be signed by; a verified client
    /// certificate's subject `O=` entries are its scopes. Needs `--tls-cert`/`--tls-key`.
    #[arg(long, env = "TROUPE_TLS_CLIENT_CA", value_name = "FILE")]
    pub tls_client_ca: Option<PathBuf>,
    /// Server reflection: `open` to anyone, `authenticated` callers only, or `off`.
    #[arg(long, env = "TROUPE_REFLECTION", value_enum, default_value_t = Reflection::Open)]
    pub reflection: Reflection,
    /// Serve on a non-loopback address without authentication (no tokens, no client CA).
    /// Without it such a server refuses to start.
    #[arg(long, env = "TROUPE_INSECURE")]
    pub insecure: bool,
    /// Also serve `grpc.health.v1.Health` alone on this address, in plaintext and without
    /// credentials: for probes that cannot speak TLS (Kubernetes' gRPC probes).
    #[arg(long, env = "TROUPE_HEALTH_LISTEN", value_name = "ADDR")]
    pub health_listen: Option<SocketAddr>,
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Access")
            .field("auth_tokens_file", &self.auth_tokens_file)
            .field(
                "auth_tokens",
                &self.auth_tokens.as_ref().map(|_| "<redacted>"),
            )
            .field("tls_client_ca", &self.tls_client_ca)
            .field("reflection", &self.reflection)
            .field("insecure", &self.insecure)
            .field("health_listen", &self.health_listen)
            .finish()
    }
}

/// What a process presents: the token it sends, the CA it trusts for `https://` URLs, and its
/// own certificate (a server's certificate, and the client certificate it sends).
#[derive(Clone, Debug, Default, clap::Args)]
pub struct Credentials {
    /// File holding the bearer token this process sends (a bare token, or a `<scopes>:<token>`
    /// line); re-read when it changes and on SIGHUP.
    #[arg(long, env = "TROUPE_TOKEN_FILE", value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// CA certificate (PEM) to verify `https://` servers with.
    #[arg(long, env = "TROUPE_TLS_CA", value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// This process's certificate chain (PEM): a server's certificate, and the client
    /// certificate it presents to `https://` servers.
    #[arg(long, env = "TROUPE_TLS_CERT", value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of `--tls-cert`.
    #[arg(long, env = "TROUPE_TLS_KEY", value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// The largest gRPC message this process accepts or sends, on its servers and its
    /// clients alike, in bytes (default 64 MiB; gRPC's own default, 4 MiB, refuses a plan of
    /// some 25,000 tasks).
    #[arg(long, env = "TROUPE_MAX_MESSAGE_BYTES", value_name = "BYTES")]
    pub max_message_bytes: Option<usize>,
}

impl Credentials {
    /// The message size limit (see `--max-message-bytes`).
    pub fn max_message(&self) -> usize {
        self.max_message_bytes
            .unwrap_or(crate::DEFAULT_MAX_MESSAGE_BYTES)
    }
}

/// A service's security settings: what it accepts and what it presents.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct Security {
    /// What this server accepts.
    #[command(flatten)]
    pub access: Access,
    /// What this process presents (server certificate; token and certificate of its calls).
    #[command(flatten)]
    pub credentials: Credentials,
}

/// The accepted credentials of a running server, built once by [`ServerAuth::load`].
#[derive(Clone, Debug)]
pub struct ServerAuth {
    pub(crate) tokens: Option<Arc<TokenSet>>,
    pub(crate) file: Option<Watched<TokenSet>>,
    pub(crate) tls: Option<ServerTls>,
    pub(crate) client_ca: bool,
    pub(crate) reflection: Reflection,
    pub(crate) insecure: bool,
    pub(crate) health_listen: Option<SocketAddr>,
}

impl Default for ServerAuth {
    /// No authentication: every RPC is open. Allowed only on loopback (or `insecure`).
    fn default() -> Self {
        Self {
            tokens: None,
            file: None,
            tls: None,
            client_ca: false,
            reflection: Reflection::Open,
            insecure: false,
            health_listen: None,
        }
    }
}

impl ServerAuth {
    /// Reads the token file, the environment's tokens and the TLS files of `security`, and
    /// starts watching the token file. Fails with the file and line of any problem, never
    /// with a token in the message.
    pub async fn load(security: &Security) -> Result<Self, Error> {
        let access = &security.access;
        let credentials = &security.credentials;
        let tokens = match &access.auth_tokens {
            Some(entries) => Some(Arc::new(TokenSet::parse_entries(
                entries,
                "TROUPE_AUTH_TOKENS",
            )?)),
            None => None,
        };
        let file = match &access.auth_tokens_file {
            Some(path) => Some(Watched::start(path.clone(), TokenSet::parse_file).await?),
            None => None,
        };
        let from_file = file.as_ref().map_or(0, |file| file.current().len());
        let from_env = tokens.as_ref().map_or(0, |set| set.len());
        if access.auth_tokens_file.is_some() || tokens.is_some() {
            tracing::info!(from_file, from_env, "accepting bearer tokens");
        }
        let tls = ServerTls::load(
            credentials.tls_cert.as_deref(),
            credentials.tls_key.as_deref(),
            access.tls_client_ca.as_deref(),
        )?;
        Ok(Self {
            tokens,
            file,
            tls,
            client_ca: access.tls_client_ca.is_some(),
            reflection: access.reflection,
            insecure: access.insecure,
            health_listen: access.health_listen,
        })
    }

    /// Adds `token` (such as the in-process workers' own) to the accepted tokens.
    pub fn accept(&mut self, token: &Token, scopes: Scopes, name: &str) {
        let mut set = self.tokens.as_deref().cloned().unwrap_or_default();
        set.insert(token, Principal::new(name, scopes));
        self.tokens = Some(Arc::new(set));
    }

    /// Whether bearer tokens are accepted (so a client certificate is optional).
    fn accepts_tokens(&self) -> bool {
        self.tokens.is_some() || self.file.is_some()
    }

    /// The server's TLS settings, if it speaks TLS.
    pub(crate) fn tls_config(&self) -> Option<tonic::transport::ServerTlsConfig> {
        self.tls
            .as_ref()
            .map(|tls| tls.config(self.accepts_tokens()))
    }

    /// The DNS names of the server's own certificate (empty without TLS).
    pub fn server_names(&self) -> &[String] {
        self.tls.as_ref().map_or(&[], |tls| tls.names.as_slice())
    }

    /// Whether any credential is required (tokens or a client CA are configured).
    pub fn is_enforced(&self) -> bool {
        self.tokens.is_some() || self.file.is_some() || self.client_ca
    }

    /// Whether the server speaks TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// What reflection does.
    pub fn reflection(&self) -> Reflection {
        self.reflection
    }

    /// Refuses to serve `addr` beyond loopback without authentication unless `insecure`.
    pub fn check_listen(&self, addr: SocketAddr) -> Result<(), Error> {
        if addr.ip().is_loopback() || self.is_enforced() || self.insecure {
            return Ok(());
        }
        Err(Error::Config(format!(
            "refusing to serve on {addr} without authentication: anyone who reaches it could \
             create, cancel or complete anything. Configure --auth-tokens-file \
             (TROUPE_AUTH_TOKENS_FILE), TROUPE_AUTH_TOKENS or --tls-client-ca \
             (TROUPE_TLS_CLIENT_CA), listen on 127.0.0.1, or pass --insecure (TROUPE_INSECURE)"
        )))
    }
}
