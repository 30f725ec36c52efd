//! Outbound channels and clients that carry this process's credentials.

use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

use crate::auth::{ClientTls, Credentials, Token, TokenSource};
use crate::{COORDINATOR_DEADLINE, CoordinatorClient, Error, Outbound};

/// Builds channels (TLS for `https://` URLs) and clients whose calls carry this process's
/// bearer token. Build once from [`Credentials`] and clone it; the default has no
/// credentials and speaks plaintext only.
#[derive(Clone, Debug, Default)]
pub struct Connector {
    tls: Option<ClientTls>,
    token: Option<TokenSource>,
    domain: Option<String>,
    /// `None`: [`crate::DEFAULT_MAX_MESSAGE_BYTES`].
    max_message: Option<usize>,
}

impl Connector {
    /// Loads the CA, certificate and token file of `credentials`, and starts watching the
    /// token file so a rotated token is sent without a restart.
    pub async fn new(credentials: &Credentials) -> Result<Self, Error> {
        let tls = ClientTls::load(
            credentials.tls_ca.as_deref(),
            credentials.tls_cert.as_deref(),
            credentials.tls_key.as_deref(),
        )?;
        let token = match &credentials.token_file {
            Some(path) => Some(TokenSource::from_file(path.clone()).await?),
            None => None,
        };
        Ok(Self {
            tls,
            token,
            domain: None,
            max_message: credentials.max_message_bytes,
        })
    }

    /// Accepts and sends messages up to `bytes` (see `--max-message-bytes`).
    pub fn with_max_message(mut self, bytes: usize) -> Self {
        self.max_message = Some(bytes);
        self
    }

    /// The largest message its clients accept or send.
    pub fn max_message(&self) -> usize {
        self.max_message.unwrap_or(crate::DEFAULT_MAX_MESSAGE_BYTES)
    }

    /// Sends `token` instead of any token file's.
    pub fn with_token(mut self, token: Token) -> Self {
        self.token = Some(TokenSource::Fixed(token));
        self
    }

    /// Verifies `https://` servers as `domain` whatever the URL's host (a process calling
    /// its own server by a loopback address).
    pub fn with_domain(mut self, domain: impl Into<String>) -> Self {
        self.domain = Some(domain.into());
        self
    }

    /// Whether calls carry a bearer token.
    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// Builds a lazy channel to `url` with a bounded connect time; `https://` URLs need the
    /// CA (`--tls-ca`). Build once and clone it.
    pub fn channel(&self, url: &str) -> Result<Channel, Error> {
        let invalid = |reason: String| Error::InvalidUrl {
            url: url.to_owned(),
            reason,
        };
        let mut endpoint =
            Endpoint::from_shared(url.to_owned()).map_err(|err| invalid(err.to_string()))?;
        if endpoint.uri().scheme_str() == Some("https") {
            let Some(tls) = &self.tls else {
                return Err(invalid(
                    "an https:// URL needs the CA that signed the server's certificate \
                     (--tls-ca, TROUPE_TLS_CA)"
                        .to_owned(),
                ));
            };
            endpoint = endpoint.tls_config(tls.config(self.domain.as_deref()))?;
        }
        Ok(endpoint
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_while_idle(true)
            .connect_lazy())
    }

    /// The outbound interceptor: `deadline` unless the caller set one, the trace context,
    /// and the bearer token.
    pub fn outbound(&self, deadline: Duration) -> Outbound {
        Outbound {
            deadline,
            token: self.token.clone(),
        }
    }

    /// A coordinator client for `url` whose calls default to a 90 s deadline (long enough
    /// for the longest `ClaimTasks` long-poll).
    pub fn coordinator_client(&self, url: &str) -> Result<CoordinatorClient, Error> {
        Ok(
            troupe_proto::v1::coordinator_client::CoordinatorClient::with_interceptor(
                self.channel(url)?,
                self.outbound(COORDINATOR_DEADLINE),
            )
            .max_decoding_message_size(self.max_message())
            .max_encoding_message_size(self.max_message()),
        )
    }
}
