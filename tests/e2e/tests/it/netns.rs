//! A network partition for tests: a network namespace joined to the host by a veth pair whose
//! link the test takes down and up. Needs root (CI runs as root); elsewhere the tests that use
//! it print a notice and pass, except under `CI=true`.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, bail};
use tokio::process::Command;

use crate::support::{ChildService, binary, free_addr};

/// A namespace with a veth pair: `host_ip` on the host side, `ns_ip` inside.
#[derive(Debug)]
pub(crate) struct Partition {
    ns: String,
    host_if: String,
    subnet: (u8, u8),
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let output = std::process::Command::new("ip")
        .args(args)
        .output()
        .context("running ip (iproute2)")?;
    if !output.status.success() {
        bail!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

impl Partition {
    /// Creates the namespace and its link (up), or `None` when this process may not.
    pub(crate) fn create() -> anyhow::Result<Option<Self>> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let root = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self")?) == 0;
        if !root {
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                bail!("the partition tests need root (network namespaces) under CI");
            }
            eprintln!("notice: not root, so no network namespace: partition test skipped");
            return Ok(None);
        }
        let pid = std::process::id();
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let partition = Self {
            ns: format!("troupe-{pid}-{n}"),
            host_if: format!("tv{}{n}", pid % 1_000_000),
            // 10.<a>.<b>.0/30 per test process and partition.
            subnet: (
                u8::try_from(200 + pid % 50).unwrap_or(200),
                u8::try_from((pid / 50 + n) % 256).unwrap_or(0),
            ),
        };
        let peer = format!("{}n", partition.host_if);
        let host_cidr = format!("{}/30", partition.host_ip());
        let ns_cidr = format!("{}/30", partition.ns_ip());
        ip(&["netns", "add", &partition.ns])?;
        ip(&[
            "link",
            "add",
            &partition.host_if,
            "type",
            "veth",
            "peer",
            "name",
            &peer,
        ])?;
        ip(&["link", "set", &peer, "netns", &partition.ns])?;
        ip(&["addr", "add", &host_cidr, "dev", &partition.host_if])?;
        ip(&["link", "set", &partition.host_if, "up"])?;
        let ns = partition.ns.as_str();
        ip(&[
            "netns", "exec", ns, "ip", "addr", "add", &ns_cidr, "dev", &peer,
        ])?;
        ip(&["netns", "exec", ns, "ip", "link", "set", &peer, "up"])?;
        ip(&["netns", "exec", ns, "ip", "link", "set", "lo", "up"])?;
        Ok(Some(partition))
    }

    fn address(&self, host: u8) -> String {
        format!("10.{}.{}.{host}", self.subnet.0, self.subnet.1)
    }

    /// The host's address on the link.
    pub(crate) fn host_ip(&self) -> String {
        self.address(1)
    }

    /// The namespace's address on the link.
    pub(crate) fn ns_ip(&self) -> String {
        self.address(2)
    }

    /// Takes the link down (a partition) or up again.
    pub(crate) fn link(&self, up: bool) -> anyhow::Result<()> {
        ip(&["link", "set", &self.host_if, if up { "up" } else { "down" }])
    }

    /// Starts a service binary inside the namespace, listening on its side of the link (so the
    /// host reaches it while the link is up), its stderr appended to `log`.
    pub(crate) async fn start_executor(
        &self,
        name: &str,
        args: &[&str],
        log: &Path,
    ) -> anyhow::Result<ChildService> {
        let addr: SocketAddr = format!("{}:{}", self.ns_ip(), free_addr().port()).parse()?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)?;
        let child = Command::new("ip")
            .args(["netns", "exec", &self.ns])
            .arg(binary(name))
            .args(args)
            .arg("--listen")
            .arg(addr.to_string())
            // The namespace's side of a test link: no credentials needed.
            .arg("--insecure")
            .env("TROUPE_LOG_FORMAT", "json")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {name} in {}", self.ns))?;
        let service = ChildService {
            name: name.to_owned(),
            addr,
            child,
            tls: None,
        };
        service.wait_serving("").await?;
        Ok(service)
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        // Deleting the namespace deletes its end of the pair, and with it the host's end.
        if let Err(err) = ip(&["netns", "del", &self.ns]) {
            eprintln!("could not remove network namespace {}: {err}", self.ns);
        }
    }
}
