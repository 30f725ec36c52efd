//! A throwaway certificate authority for TLS tests, written as PEM files into a directory
//! the test owns (private keys are made per test run and never committed).

use std::path::{Path, PathBuf};

use anyhow::Context;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// A certificate and its key as PEM files.
#[derive(Clone, Debug)]
pub struct Pair {
    /// The certificate (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
}

impl Pair {
    /// The certificate's path as a string, for command lines.
    pub fn cert_arg(&self) -> String {
        self.cert.display().to_string()
    }

    /// The key's path as a string, for command lines.
    pub fn key_arg(&self) -> String {
        self.key.display().to_string()
    }
}

/// A CA that signs server and client certificates into `dir`.
pub struct Pki {
    dir: PathBuf,
    ca: CertifiedIssuer<'static, KeyPair>,
    /// The CA certificate (PEM), what clients and servers trust.
    pub ca_cert: PathBuf,
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pki").field("dir", &self.dir).finish()
    }
}

impl Pki {
    /// A new CA named `name`, its certificate written to `dir/<name>.pem`.
    pub fn new(dir: &Path, name: &str) -> anyhow::Result<Self> {
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        let ca_cert = dir.join(format!("{name}.pem"));
        std::fs::write(&ca_cert, ca.pem()).context("writing the CA certificate")?;
        Ok(Self {
            dir: dir.to_path_buf(),
            ca,
            ca_cert,
        })
    }

    /// A server certificate for `names` (DNS names or IP addresses), good for client
    /// authentication too, with subject `CN=<file>` and `O=<organization>` when given.
    pub fn server(
        &self,
        file: &str,
        names: &[&str],
        organization: Option<&str>,
    ) -> anyhow::Result<Pair> {
        let mut params =
            CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())?;
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        self.issue(file, params, organization)
    }

    /// A client certificate `CN=<file>` with `O=<organization>` when given (troupe reads its
    /// scopes from `O=`; rcgen writes at most one).
    pub fn client(&self, file: &str, organization: Option<&str>) -> anyhow::Result<Pair> {
        let mut params = CertificateParams::default();
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.issue(file, params, organization)
    }

    fn issue(
        &self,
        file: &str,
        mut params: CertificateParams,
        organization: Option<&str>,
    ) -> anyhow::Result<Pair> {
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, file);
        if let Some(organization) = organization {
            params
                .distinguished_name
                .push(DnType::OrganizationName, organization);
        }
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.ca)?;
        let pair = Pair {
            cert: self.dir.join(format!("{file}.pem")),
            key: self.dir.join(format!("{file}-key.pem")),
        };
        std::fs::write(&pair.cert, cert.pem()).context("writing a certificate")?;
        std::fs::write(&pair.key, key.serialize_pem()).context("writing a key")?;
        Ok(pair)
    }
}
