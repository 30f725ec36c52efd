//! The tower layer that authorizes every request before it reaches a service.

use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::{Either, Ready, ready};
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use super::policy::{self, Rule};
use super::{Principal, ServerAuth, peer_principal};

/// Puts [`Auth`] in front of a service.
#[derive(Clone, Debug)]
pub(crate) struct AuthLayer {
    auth: Option<Arc<ServerAuth>>,
}

impl AuthLayer {
    /// Checks requests against `auth`; lets everything through when it enforces nothing.
    pub(crate) fn new(auth: &ServerAuth) -> Self {
        Self {
            auth: auth.is_enforced().then(|| Arc::new(auth.clone())),
        }
    }
}

impl<S> tower::Layer<S> for AuthLayer {
    type Service = Auth<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Auth {
            inner,
            auth: self.auth.clone(),
        }
    }
}

/// Refuses requests whose caller lacks the scope the RPC needs.
#[derive(Clone, Debug)]
pub(crate) struct Auth<S> {
    inner: S,
    auth: Option<Arc<ServerAuth>>,
}

type Response = http::Response<tonic::body::Body>;

impl<S, B> tower::Service<http::Request<B>> for Auth<S>
where
    S: tower::Service<http::Request<B>, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Either<Ready<Result<Response, S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let Some(auth) = &self.auth else {
            return Either::Right(self.inner.call(request));
        };
        match authorize(auth, &request) {
            Ok(principal) => {
                // Who called, for the handlers that record it (a gate's answer).
                if let Some(principal) = principal {
                    request.extensions_mut().insert(principal);
                }
                Either::Right(self.inner.call(request))
            }
            Err(status) => {
                tracing::warn!(
                    rpc = %request.uri().path(),
                    peer = %peer(&request),
                    code = ?status.code(),
                    reason = %status.message(),
                    "request refused"
                );
                Either::Left(ready(Ok(status.into_http())))
            }
        }
    }
}

/// Checks a request that is not gRPC (the coordinator's web view) as if it called `rpc_path`
/// (`/troupe.v1.Coordinator/GetSession`) with `headers`: the same tokens, scopes and answers
/// as the API. Only bearer tokens apply: the web view serves no client certificates. Returns
/// who is calling (`None` on a server without authentication).
pub fn authorize_as(
    auth: &ServerAuth,
    rpc_path: &str,
    headers: &http::HeaderMap,
) -> Result<Option<Principal>, tonic::Status> {
    // A server without authentication is open, as its gRPC port is (no layer is installed).
    if !auth.is_enforced() {
        return Ok(None);
    }
    let mut request = http::Request::new(());
    *request.uri_mut() = http::Uri::try_from(rpc_path)
        .map_err(|_| tonic::Status::internal(format!("`{rpc_path}` is not an RPC path")))?;
    *request.headers_mut() = headers.clone();
    authorize(auth, &request)
}

/// Checks a request; returns who is calling when the RPC is not open.
fn authorize<B>(
    auth: &ServerAuth,
    request: &http::Request<B>,
) -> Result<Option<Principal>, tonic::Status> {
    let path = request.uri().path();
    let needed = match policy::rule(path, auth.reflection) {
        Rule::Open => return Ok(None),
        Rule::Needs(needed) => needed,
    };
    let principal = principal(auth, request)?;
    if policy::allows(principal.scopes, needed) {
        return Ok(Some(principal));
    }
    Err(tonic::Status::permission_denied(format!(
        "{} (scopes: {}) may not call {path}: it needs {}",
        principal.name,
        principal.scopes,
        if needed.is_empty() {
            "admin".to_owned()
        } else {
            format!("{needed} or admin")
        }
    )))
}

/// Who is calling: the bearer token if one is sent, else the verified client certificate.
fn principal<B>(auth: &ServerAuth, request: &http::Request<B>) -> Result<Principal, tonic::Status> {
    if let Some(value) = request.headers().get(http::header::AUTHORIZATION) {
        let presented = value
            .to_str()
            .ok()
            .and_then(|value| value.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or_else(|| {
                tonic::Status::unauthenticated("the authorization header must be `Bearer <token>`")
            })?;
        let known = auth
            .tokens
            .as_ref()
            .and_then(|set| set.get(presented).cloned())
            .or_else(|| {
                auth.file
                    .as_ref()
                    .and_then(|file| file.current().get(presented).cloned())
            });
        return known.ok_or_else(|| tonic::Status::unauthenticated("unknown bearer token"));
    }
    let certificate = request
        .extensions()
        .get::<TlsConnectInfo<TcpConnectInfo>>()
        .and_then(TlsConnectInfo::peer_certs)
        .and_then(|chain| chain.first().map(|cert| peer_principal(cert)));
    certificate.ok_or_else(|| {
        tonic::Status::unauthenticated(
            "credentials required: send `authorization: Bearer <token>` or a client certificate",
        )
    })
}

fn peer<B>(request: &http::Request<B>) -> String {
    let extensions = request.extensions();
    extensions
        .get::<TcpConnectInfo>()
        .or_else(|| {
            extensions
                .get::<TlsConnectInfo<TcpConnectInfo>>()
                .map(TlsConnectInfo::get_ref)
        })
        .and_then(TcpConnectInfo::remote_addr)
        .map_or_else(|| "unknown".to_owned(), |addr| addr.to_string())
}
