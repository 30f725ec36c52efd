//! Bearer tokens: their file format, the accepted set, and files reloaded on change.
//!
//! A token file holds one `<scopes>:<token>` entry per line: `scopes` is a comma-separated
//! list of `worker`, `client`, `admin`; `token` is at least 16 characters of
//! `A-Z a-z 0-9 - . _ ~ + / =` (RFC 6750's `b64token`, so it can never hold `:` or a space).
//! Blank lines and lines starting with `#` are skipped. `TROUPE_AUTH_TOKENS` takes the same
//! entries separated by whitespace. A client's token file holds its token alone, or one such
//! entry (the scopes are the server's business and are ignored).

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio_util::sync::{CancellationToken, DropGuard};

use super::{Scope, Scopes};
use crate::Error;

/// Shortest token accepted: guessing one must stay out of reach.
const MIN_TOKEN_LEN: usize = 16;

/// How long a change settles before the file is read (an editor writes in several steps).
const SETTLE: Duration = Duration::from_millis(100);

/// A bearer token. Its `Debug` shows only a fingerprint.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl Token {
    /// Checks `text` is a usable token; the error says why without repeating it.
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.len() < MIN_TOKEN_LEN {
            return Err(format!(
                "a token must be at least {MIN_TOKEN_LEN} characters long"
            ));
        }
        if let Some(bad) = text
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || "-._~+/=".contains(*c)))
        {
            return Err(format!(
                "a token may hold only A-Z a-z 0-9 - . _ ~ + / =, not {}",
                if bad.is_ascii_graphic() {
                    format!("`{bad}`")
                } else {
                    format!("U+{:04X}", u32::from(bad))
                }
            ));
        }
        // Whoever holds it has its scopes: it is masked wherever troupe writes.
        troupe_telemetry::register_secret(text);
        Ok(Self(text.to_owned()))
    }

    /// A fresh random token (256 bits, hex).
    pub fn generate() -> Self {
        let bytes: [u8; 32] = rand::random();
        let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        troupe_telemetry::register_secret(&token);
        Self(token)
    }

    /// The token itself, for writing it where a client reads it. Never log it.
    pub fn secret(&self) -> &str {
        &self.0
    }

    /// `sha256:` and the first 8 hex digits of the token's SHA-256: names a token in logs.
    pub fn fingerprint(&self) -> String {
        let digest = self.digest();
        format!(
            "sha256:{}",
            digest[..4]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        )
    }

    pub(crate) fn digest(&self) -> [u8; 32] {
        Sha256::digest(self.0.as_bytes()).into()
    }

    /// The `authorization` value to send, marked sensitive so HTTP/2 never indexes it.
    pub(crate) fn header(&self) -> Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>> {
        let mut value: tonic::metadata::MetadataValue<_> =
            format!("Bearer {}", self.0).parse().ok()?;
        value.set_sensitive(true);
        Some(value)
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({})", self.fingerprint())
    }
}

/// Who a caller is, as far as authorization goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    /// How logs name it: `token sha256:…` or `certificate CN=…`.
    pub name: String,
    /// What it may do.
    pub scopes: Scopes,
}

impl Principal {
    /// A principal `name` holding `scopes`.
    pub fn new(name: impl Into<String>, scopes: Scopes) -> Self {
        Self {
            name: name.into(),
            scopes,
        }
    }
}

/// Accepted tokens, found by their SHA-256 (the set never holds a token itself).
#[derive(Clone, Default)]
pub(crate) struct TokenSet {
    by_digest: HashMap<[u8; 32], Principal>,
}

impl fmt::Debug for TokenSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TokenSet({} tokens)", self.by_digest.len())
    }
}

impl TokenSet {
    pub(crate) fn insert(&mut self, token: &Token, principal: Principal) {
        self.by_digest.insert(token.digest(), principal);
    }

    /// The principal a presented token belongs to.
    pub(crate) fn get(&self, presented: &str) -> Option<&Principal> {
        let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        self.by_digest.get(&digest)
    }

    pub(crate) fn len(&self) -> usize {
        self.by_digest.len()
    }

    /// Parses whitespace-separated entries from `source` (an environment variable's name).
    pub(crate) fn parse_entries(text: &str, source: &str) -> Result<Self, Error> {
        let mut set = Self::default();
        for (index, entry) in text.split_whitespace().enumerate() {
            set.add_entry(entry).map_err(|reason| {
                Error::Config(format!("{source} entry {}: {reason}", index + 1))
            })?;
        }
        Ok(set)
    }

    /// Parses a token file; errors name `path` and the line.
    pub(crate) fn parse_file(path: &Path, text: &str) -> Result<Self, Error> {
        let mut set = Self::default();
        for (index, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            set.add_entry(line).map_err(|reason| {
                Error::Config(format!("{}:{}: {reason}", path.display(), index + 1))
            })?;
        }
        Ok(set)
    }

    fn add_entry(&mut self, entry: &str) -> Result<(), String> {
        let Some((scope_list, token)) = entry.split_once(':') else {
            return Err("expected `<scopes>:<token>`, such as `worker:<token>`".to_owned());
        };
        let mut scopes = Scopes::NONE;
        for name in scope_list.split(',').map(str::trim) {
            let scope = Scope::parse(name).ok_or_else(|| {
                format!("unknown scope `{name}`: use worker, client or admin, comma-separated")
            })?;
            scopes.insert(scope);
        }
        let token = Token::parse(token.trim())?;
        let principal = Principal::new(format!("token {}", token.fingerprint()), scopes);
        if self.by_digest.insert(token.digest(), principal).is_some() {
            return Err("this token is listed twice".to_owned());
        }
        Ok(())
    }
}

/// Reads a client's token file: the first entry, a bare token or `<scopes>:<token>`.
pub(crate) fn parse_client_token(path: &Path, text: &str) -> Result<Token, Error> {
    let line = text
        .lines()
        .map(str::trim)
        .find(|line| !line.is_empty() && !line.starts_with('#'))
        .ok_or_else(|| Error::Config(format!("{} holds no token", path.display())))?;
    let token = line.rsplit_once(':').map_or(line, |(_, token)| token);
    Token::parse(token.trim())
        .map_err(|reason| Error::Config(format!("{}: {reason}", path.display())))
}

/// A value parsed from a file and parsed again whenever the file changes (inotify on its
/// directory, so Kubernetes' symlink swaps of mounted Secrets count) or the process gets
/// SIGHUP. A file that cannot be read or parsed leaves the last good value in force and logs
/// why. Clones share the value; the watch stops when the last clone is dropped.
pub(crate) struct Watched<T> {
    current: Arc<RwLock<Arc<T>>>,
    _stop: Arc<DropGuard>,
}

impl<T> Clone for Watched<T> {
    fn clone(&self) -> Self {
        Self {
            current: Arc::clone(&self.current),
            _stop: Arc::clone(&self._stop),
        }
    }
}

impl<T> fmt::Debug for Watched<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Watched")
    }
}

/// Parses a file's text; `path` is for error messages.
pub(crate) type Parse<T> = fn(&Path, &str) -> Result<T, Error>;

impl<T: Send + Sync + 'static> Watched<T> {
    /// Reads and parses `path` (an error if that fails) and starts watching it.
    pub(crate) async fn start(path: PathBuf, parse: Parse<T>) -> Result<Self, Error> {
        let text = read(&path).await?;
        let current = Arc::new(RwLock::new(Arc::new(parse(&path, &text)?)));
        let changed = Arc::new(tokio::sync::Notify::new());
        let watcher = watch_dir(&path, Arc::clone(&changed))?;
        let hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .map_err(|err| Error::Config(format!("cannot listen for SIGHUP: {err}")))?;
        let stop = CancellationToken::new();
        tokio::spawn(reload_loop(
            path,
            parse,
            text,
            Arc::clone(&current),
            changed,
            hangup,
            watcher,
            stop.clone(),
        ));
        Ok(Self {
            current,
            _stop: Arc::new(stop.drop_guard()),
        })
    }

    /// The value now in force.
    pub(crate) fn current(&self) -> Arc<T> {
        match self.current.read() {
            Ok(value) => Arc::clone(&value),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }
}

async fn read(path: &Path) -> Result<String, Error> {
    tokio::fs::read_to_string(path)
        .await
        .map_err(|err| Error::Config(format!("cannot read {}: {err}", path.display())))
}

/// Watches the directory of `path`: a file replaced by rename or a symlink swap is seen.
fn watch_dir(
    path: &Path,
    changed: Arc<tokio::sync::Notify>,
) -> Result<notify::RecommendedWatcher, Error> {
    use notify::{EventKind, Watcher, event::AccessKind, event::AccessMode};
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        let relevant = match event {
            // Our own reads open and close the file: only a write that closes counts.
            Ok(event) => match event.kind {
                EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
                EventKind::Access(_) => false,
                _ => true,
            },
            Err(_) => true,
        };
        if relevant {
            changed.notify_one();
        }
    })
    .map_err(|err| Error::Config(format!("cannot watch {}: {err}", dir.display())))?;
    watcher
        .watch(&dir, notify::RecursiveMode::NonRecursive)
        .map_err(|err| Error::Config(format!("cannot watch {}: {err}", dir.display())))?;
    Ok(watcher)
}

#[allow(clippy::too_many_arguments)] // the loop's whole state, moved into its task once
async fn reload_loop<T: Send + Sync + 'static>(
    path: PathBuf,
    parse: Parse<T>,
    mut last_text: String,
    current: Arc<RwLock<Arc<T>>>,
    changed: Arc<tokio::sync::Notify>,
    mut hangup: tokio::signal::unix::Signal,
    _watcher: notify::RecommendedWatcher,
    stop: CancellationToken,
) {
    loop {
        let signalled = tokio::select! {
            () = stop.cancelled() => return,
            () = changed.notified() => false,
            _ = hangup.recv() => true,
        };
        if !signalled {
            tokio::time::sleep(SETTLE).await;
        }
        let text = match read(&path).await {
            Ok(text) => text,
            Err(err) => {
                tracing::error!(error = %err, "credentials file unreadable, keeping the previous one");
                continue;
            }
        };
        if text == last_text && !signalled {
            continue;
        }
        match parse(&path, &text) {
            Ok(value) => {
                if let Ok(mut slot) = current.write() {
                    *slot = Arc::new(value);
                }
                tracing::info!(file = %path.display(), sighup = signalled, "credentials file reloaded");
                last_text = text;
            }
            Err(err) => {
                tracing::error!(error = %err, "credentials file invalid, keeping the previous one");
            }
        }
    }
}

/// Where a client's token comes from.
#[derive(Clone, Debug)]
pub(crate) enum TokenSource {
    Fixed(Token),
    File(Watched<Token>),
}

impl TokenSource {
    pub(crate) async fn from_file(path: PathBuf) -> Result<Self, Error> {
        Ok(Self::File(Watched::start(path, parse_client_token).await?))
    }

    pub(crate) fn current(&self) -> Token {
        match self {
            Self::Fixed(token) => token.clone(),
            Self::File(watched) => Token::clone(&watched.current()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "0123456789abcdef-long";

    #[test]
    fn a_file_lists_scoped_tokens_and_skips_comments() {
        let text =
            format!("# comment\n\nworker:{GOOD}1\nclient,admin:{GOOD}2\n  admin : {GOOD}3  \n");
        let set = TokenSet::parse_file(Path::new("t"), &text).unwrap();
        assert_eq!(set.len(), 3);
        assert_eq!(
            set.get(&format!("{GOOD}1")).unwrap().scopes,
            Scopes::of(&[Scope::Worker])
        );
        assert_eq!(
            set.get(&format!("{GOOD}2")).unwrap().scopes,
            Scopes::of(&[Scope::Client, Scope::Admin])
        );
        assert!(set.get(&format!("{GOOD}3")).is_some());
        assert!(set.get("nope-nope-nope-nope").is_none());
    }

    #[test]
    fn errors_name_the_line_and_never_the_token() {
        for (text, expected) in [
            (format!("worker {GOOD}"), "t:1: expected `<scopes>:<token>`"),
            (format!("\nwork:{GOOD}"), "t:2: unknown scope `work`"),
            (
                "client:short".to_owned(),
                "t:1: a token must be at least 16",
            ),
            (format!("client:{GOOD}!x"), "may hold only"),
            (
                format!("client:{GOOD}\nadmin:{GOOD}"),
                "t:2: this token is listed twice",
            ),
        ] {
            let err = TokenSet::parse_file(Path::new("t"), &text)
                .unwrap_err()
                .to_string();
            assert!(err.contains(expected), "{err}");
            assert!(!err.contains(GOOD) && !err.contains("short"), "{err}");
        }
    }

    #[test]
    fn environment_entries_are_whitespace_separated() {
        let set =
            TokenSet::parse_entries(&format!("worker:{GOOD}1 \n client:{GOOD}2"), "ENV").unwrap();
        assert_eq!(set.len(), 2);
        let err = TokenSet::parse_entries(&format!("worker:{GOOD}1 nope"), "ENV").unwrap_err();
        assert!(err.to_string().starts_with("ENV entry 2:"), "{err}");
    }

    #[test]
    fn a_client_file_holds_a_bare_token_or_an_entry() {
        let path = Path::new("c");
        assert_eq!(
            parse_client_token(path, &format!("# mine\n{GOOD}\n"))
                .unwrap()
                .secret(),
            GOOD
        );
        assert_eq!(
            parse_client_token(path, &format!("worker:{GOOD}"))
                .unwrap()
                .secret(),
            GOOD
        );
        assert!(parse_client_token(path, "# nothing\n").is_err());
    }

    #[test]
    fn debug_shows_a_fingerprint_only() {
        let token = Token::parse(GOOD).unwrap();
        let shown = format!("{token:?}");
        assert!(
            shown.starts_with("Token(sha256:") && !shown.contains(GOOD),
            "{shown}"
        );
        assert_eq!(Token::generate().secret().len(), 64);
    }
}
