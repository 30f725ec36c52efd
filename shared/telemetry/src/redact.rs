//! Known secret values (API keys, bearer tokens, git tokens) and their removal from everything
//! troupe writes: log lines, exported spans, and (through [`redact_bytes`]) task results.
//!
//! Services register the secrets they load ([`register_secret`]); [`crate::init`] also
//! registers the values of variables whose names say they hold one (`*_API_KEY`, `*_TOKEN`,
//! `*_SECRET`, `*_PASSWORD`, `TROUPE_AUTH_TOKENS`). Values shorter than
//! [`MIN_SECRET_LEN`] are ignored: masking every `test` would wreck the logs and protect
//! nothing.

use std::borrow::Cow;
use std::io::Write;
use std::sync::RwLock;

use opentelemetry::{KeyValue, Value};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SpanData, SpanExporter};

/// The shortest value treated as a secret.
pub const MIN_SECRET_LEN: usize = 8;

/// What a secret is replaced with in logs and spans.
pub const REDACTED: &str = "[redacted]";

static SECRETS: RwLock<Vec<String>> = RwLock::new(Vec::new());

/// Suffixes (and names) of environment variables whose values are secrets.
const SECRET_VARS: &[&str] = &["_API_KEY", "_TOKEN", "_SECRET", "_PASSWORD", "_AUTH_TOKENS"];

/// Remembers `value` as a secret: from now on it is masked wherever troupe writes it.
pub fn register_secret(value: impl AsRef<str>) {
    let value = value.as_ref().trim();
    if value.len() < MIN_SECRET_LEN {
        return;
    }
    let mut secrets = SECRETS
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if !secrets.iter().any(|known| known == value) {
        secrets.push(value.to_owned());
        // Longest first, so a secret containing another is masked whole.
        secrets.sort_by_key(|secret| std::cmp::Reverse(secret.len()));
    }
}

/// Registers the values of our variables whose names say they hold a secret; an entry of
/// `TROUPE_AUTH_TOKENS` (`scopes:token`) registers its token.
pub fn register_secrets_from_env() {
    for (name, value) in std::env::vars() {
        if !SECRET_VARS.iter().any(|suffix| name.ends_with(suffix)) {
            continue;
        }
        for word in value.split_whitespace() {
            register_secret(word.rsplit_once(':').map_or(word, |(_, token)| token));
        }
        register_secret(&value);
    }
}

/// `text` with every known secret replaced by [`REDACTED`].
pub fn redact(text: &str) -> Cow<'_, str> {
    let secrets = SECRETS
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let mut out = Cow::Borrowed(text);
    for secret in secrets.iter() {
        if out.contains(secret.as_str()) {
            out = Cow::Owned(out.replace(secret.as_str(), REDACTED));
        }
    }
    out
}

/// Masks every known secret in `bytes` with `*` of the same length. Same length keeps an
/// encoded protobuf message valid, so a whole task result can be cleaned without knowing its
/// fields; returns whether anything was masked.
pub fn redact_bytes(bytes: &mut [u8]) -> bool {
    let secrets = SECRETS
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let mut masked = false;
    for secret in secrets.iter().map(String::as_bytes) {
        let mut start = 0;
        while let Some(at) = bytes[start..]
            .windows(secret.len())
            .position(|window| window == secret)
        {
            let at = start + at;
            bytes[at..at + secret.len()].fill(b'*');
            masked = true;
            start = at + secret.len();
        }
    }
    masked
}

/// A log writer that masks secrets in every formatted event before it reaches stderr.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RedactingStderr;

impl Write for RedactingStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let text = String::from_utf8_lossy(buf);
        std::io::stderr().write_all(redact(&text).as_bytes())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for RedactingStderr {
    type Writer = RedactingStderr;

    fn make_writer(&'a self) -> Self::Writer {
        *self
    }
}

/// An OTLP exporter that masks secrets in span names, attributes, events and status before
/// they leave the process.
#[derive(Debug)]
pub(crate) struct RedactingExporter<E>(pub(crate) E);

fn redact_attributes(attributes: &mut [KeyValue]) {
    for attribute in attributes {
        if let Value::String(value) = &attribute.value
            && let Cow::Owned(clean) = redact(value.as_str())
        {
            attribute.value = Value::String(clean.into());
        }
    }
}

fn redact_span(span: &mut SpanData) {
    if let Cow::Owned(clean) = redact(&span.name) {
        span.name = clean.into();
    }
    redact_attributes(&mut span.attributes);
    for event in &mut span.events.events {
        if let Cow::Owned(clean) = redact(&event.name) {
            event.name = clean.into();
        }
        redact_attributes(&mut event.attributes);
    }
    if let opentelemetry::trace::Status::Error { description } = &span.status
        && let Cow::Owned(clean) = redact(description)
    {
        span.status = opentelemetry::trace::Status::Error {
            description: clean.into(),
        };
    }
}

impl<E: SpanExporter> SpanExporter for RedactingExporter<E> {
    async fn export(&self, mut batch: Vec<SpanData>) -> OTelSdkResult {
        batch.iter_mut().for_each(redact_span);
        self.0.export(batch).await
    }

    fn shutdown_with_timeout(&self, timeout: std::time::Duration) -> OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.0.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.0.set_resource(resource);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_masked_in_text_and_bytes() {
        register_secret("sk-redact-test-0123456789");
        register_secret("short");
        assert_eq!(
            redact("key sk-redact-test-0123456789 and short"),
            "key [redacted] and short"
        );
        let mut bytes = b"\x0a\x1bsk-redact-test-0123456789!".to_vec();
        assert!(redact_bytes(&mut bytes));
        assert_eq!(&bytes[..2], b"\x0a\x1b");
        assert_eq!(&bytes[2..], b"*************************!");
        assert!(!redact_bytes(&mut b"nothing here".to_vec()));
    }
}
