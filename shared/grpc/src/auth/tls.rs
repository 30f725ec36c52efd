//! TLS with rustls: the server's certificate and optional client CA, a client's trusted CA and
//! certificate, and the scopes a verified client certificate carries.
//!
//! A client certificate's scopes are the subject's Organization (`O=`) entries that name a
//! scope (`O=worker`, `O=client`, `O=admin`; several `O=` give several scopes), as Kubernetes
//! reads a certificate's groups from `O=`. Its Common Name names it in logs. The client CA is
//! what grants scopes, so give troupe a CA of its own.

use std::path::Path;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

use super::{Principal, Scope, Scopes};
use crate::Error;

/// How long a TLS handshake may take before the connection is dropped.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

fn read(path: &Path, what: &str) -> Result<Vec<u8>, Error> {
    std::fs::read(path).map_err(|err| Error::Config(format!("{what} {}: {err}", path.display())))
}

/// Reads PEM certificates from `path`, refusing a file that holds none.
fn certificates(path: &Path, what: &str) -> Result<(Vec<u8>, Vec<CertificateDer<'static>>), Error> {
    let pem = read(path, what)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| Error::Config(format!("{what} {}: {err}", path.display())))?;
    if certs.is_empty() {
        return Err(Error::Config(format!(
            "{what} {} holds no PEM certificate",
            path.display()
        )));
    }
    Ok((pem, certs))
}

/// Reads `cert` and `key` as an identity, checking both parse.
fn identity(cert: &Path, key: &Path) -> Result<(Identity, Vec<CertificateDer<'static>>), Error> {
    let (cert_pem, chain) = certificates(cert, "--tls-cert")?;
    let key_pem = read(key, "--tls-key")?;
    rustls::pki_types::PrivateKeyDer::from_pem_slice(&key_pem).map_err(|err| {
        Error::Config(format!(
            "--tls-key {}: no usable PEM private key ({err})",
            key.display()
        ))
    })?;
    Ok((Identity::from_pem(cert_pem, key_pem), chain))
}

fn pair<'a>(
    cert: Option<&'a Path>,
    key: Option<&'a Path>,
) -> Result<Option<(&'a Path, &'a Path)>, Error> {
    match (cert, key) {
        (Some(cert), Some(key)) => Ok(Some((cert, key))),
        (None, None) => Ok(None),
        (Some(_), None) => Err(Error::Config("--tls-cert needs --tls-key".to_owned())),
        (None, Some(_)) => Err(Error::Config("--tls-key needs --tls-cert".to_owned())),
    }
}

/// A server's TLS material, loaded and checked at start. Its `Debug` leaves the key out
/// (tonic's `Identity` would print it).
#[derive(Clone)]
pub(crate) struct ServerTls {
    identity: Identity,
    client_ca: Option<Certificate>,
    /// The DNS names of the server's certificate, for clients in the same process.
    pub(crate) names: Vec<String>,
}

impl ServerTls {
    pub(crate) fn load(
        cert: Option<&Path>,
        key: Option<&Path>,
        client_ca: Option<&Path>,
    ) -> Result<Option<Self>, Error> {
        let Some((cert, key)) = pair(cert, key)? else {
            if client_ca.is_some() {
                return Err(Error::Config(
                    "--tls-client-ca needs the server's own --tls-cert and --tls-key".to_owned(),
                ));
            }
            return Ok(None);
        };
        let (identity, chain) = identity(cert, key)?;
        let names = dns_names(&chain[0]);
        let client_ca = match client_ca {
            Some(path) => Some(Certificate::from_pem(
                certificates(path, "--tls-client-ca")?.0,
            )),
            None => None,
        };
        Ok(Some(Self {
            identity,
            client_ca,
            names,
        }))
    }

    /// The rustls settings; a client certificate is optional when tokens are accepted too.
    pub(crate) fn config(&self, tokens_accepted: bool) -> ServerTlsConfig {
        let mut config = ServerTlsConfig::new()
            .identity(self.identity.clone())
            .timeout(HANDSHAKE_TIMEOUT);
        if let Some(ca) = &self.client_ca {
            config = config
                .client_ca_root(ca.clone())
                .client_auth_optional(tokens_accepted);
        }
        config
    }
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("names", &self.names)
            .field("client_ca", &self.client_ca.is_some())
            .finish_non_exhaustive()
    }
}

/// A client's TLS settings for `https://` URLs. Its `Debug` leaves the key out.
#[derive(Clone)]
pub(crate) struct ClientTls {
    config: ClientTlsConfig,
    has_identity: bool,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("client_certificate", &self.has_identity)
            .finish_non_exhaustive()
    }
}

impl ClientTls {
    pub(crate) fn load(
        ca: Option<&Path>,
        cert: Option<&Path>,
        key: Option<&Path>,
    ) -> Result<Option<Self>, Error> {
        let identity = pair(cert, key)?;
        let Some(ca) = ca else {
            return Ok(None);
        };
        let mut config = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(certificates(ca, "--tls-ca")?.0));
        if let Some((cert, key)) = identity {
            config = config.identity(identity_of(cert, key)?);
        }
        Ok(Some(Self {
            config,
            has_identity: identity.is_some(),
        }))
    }

    /// The settings, verifying the server as `domain` instead of the URL's host when given.
    pub(crate) fn config(&self, domain: Option<&str>) -> ClientTlsConfig {
        match domain {
            Some(domain) => self.config.clone().domain_name(domain),
            None => self.config.clone(),
        }
    }
}

fn identity_of(cert: &Path, key: &Path) -> Result<Identity, Error> {
    identity(cert, key).map(|(identity, _)| identity)
}

/// The DNS names (subject alternative names) of a certificate.
fn dns_names(cert: &CertificateDer<'_>) -> Vec<String> {
    let Ok((_, parsed)) = X509Certificate::from_der(cert.as_ref()) else {
        return Vec::new();
    };
    let Ok(Some(san)) = parsed.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|name| match name {
            GeneralName::DNSName(dns) => Some((*dns).to_owned()),
            _ => None,
        })
        .collect()
}

/// The principal of a verified client certificate (the chain's first certificate): named by
/// its Common Name, with the scopes its `O=` entries name.
pub(crate) fn peer_principal(cert: &CertificateDer<'_>) -> Principal {
    let Ok((_, parsed)) = X509Certificate::from_der(cert.as_ref()) else {
        return Principal::new("certificate (unparsable)", Scopes::NONE);
    };
    let subject = parsed.subject();
    let mut scopes = Scopes::NONE;
    for organization in subject.iter_organization() {
        if let Some(scope) = organization.as_str().ok().and_then(Scope::parse) {
            scopes.insert(scope);
        }
    }
    let common_name = subject
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .unwrap_or("?");
    Principal::new(format!("certificate CN={common_name}"), scopes)
}
