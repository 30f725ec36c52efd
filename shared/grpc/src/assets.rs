//! Plan assets: the files a plan refers to through `{plan_dir}` (agent scripts, an EXEC
//! phase's task files) travel with the plan, so a worker on another machine has them.
//!
//! The submitting client sends them with `CreateSession`; the coordinator checks and stores
//! them once per content, under the SHA-256 of their bundle (the encoded
//! `GetPlanAssetsResponse`, files sorted by path), and names that digest in every claim. A
//! worker fetches a digest it has not seen with `GetPlanAssets`, checks it, and writes the
//! files under its own cache directory, which then serves as the task's `{plan_dir}`.

use std::path::{Component, Path, PathBuf};

use prost::Message;
use sha2::{Digest, Sha256};
use troupe_proto::v1::{GetPlanAssetsRequest, GetPlanAssetsResponse, PlanAsset};

use crate::{CoordinatorClient, Error};

/// The most files a plan may bring.
pub const MAX_FILES: usize = 1000;

/// The most bytes a plan's files may hold in all.
pub const MAX_BYTES: usize = 16 << 20;

/// Checks `assets` (relative paths without `..`, each once, within the bounds) and returns
/// their digest and encoded bundle.
pub fn bundle(mut assets: Vec<PlanAsset>) -> Result<(String, Vec<u8>), String> {
    if assets.len() > MAX_FILES {
        return Err(format!(
            "the plan brings {} files; at most {MAX_FILES} travel with a plan (put the rest in a repository)",
            assets.len()
        ));
    }
    let total: usize = assets.iter().map(|asset| asset.content.len()).sum();
    if total > MAX_BYTES {
        return Err(format!(
            "the plan's files hold {:.1} MiB; at most {} MiB travel with a plan (put the rest in a repository)",
            total as f64 / f64::from(1 << 20),
            MAX_BYTES >> 20
        ));
    }
    for asset in &assets {
        let path = Path::new(&asset.path);
        let plain = !asset.path.is_empty()
            && !asset.path.contains('\\')
            && path
                .components()
                .all(|component| matches!(component, Component::Normal(_)));
        if !plain {
            return Err(format!(
                "plan asset `{}` must be a relative path inside the plan directory",
                asset.path
            ));
        }
    }
    assets.sort_by(|a, b| a.path.cmp(&b.path));
    if let Some(twice) = assets.windows(2).find(|pair| pair[0].path == pair[1].path) {
        return Err(format!("plan asset `{}` is given twice", twice[0].path));
    }
    let encoded = GetPlanAssetsResponse { assets }.encode_to_vec();
    Ok((digest_of(&encoded), encoded))
}

fn digest_of(encoded: &[u8]) -> String {
    Sha256::digest(encoded)
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// The directory holding the bundle `digest` under `cache`: written once, from
/// `GetPlanAssets`, and reused by every later task of any session that brings the same files.
pub async fn materialize(
    client: &CoordinatorClient,
    cache: &Path,
    digest: &str,
) -> Result<PathBuf, Error> {
    let valid = digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit());
    if !valid {
        return Err(Error::Assets(format!("malformed assets digest `{digest}`")));
    }
    let dir = cache.join(digest);
    // One materialisation at a time in this process: a worker's slots claim tasks of one plan
    // together and need the same bundle (two slots writing one per-process aside directory
    // failed a task about one run in six with its files missing).
    static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _turn = TURN.lock().await;
    if tokio::fs::try_exists(&dir).await.unwrap_or(false) {
        return Ok(dir);
    }
    let response = client
        .clone()
        .get_plan_assets(GetPlanAssetsRequest {
            digest: digest.to_owned(),
        })
        .await
        .map_err(|status| {
            Error::Assets(format!(
                "fetching plan assets {digest}: {}",
                status.message()
            ))
        })?
        .into_inner();
    let encoded = response.encode_to_vec();
    if digest_of(&encoded) != digest {
        return Err(Error::Assets(format!(
            "the plan assets the coordinator sent do not match their digest {digest}"
        )));
    }
    let io = |path: &Path, err: std::io::Error| Error::Assets(format!("{}: {err}", path.display()));
    // Written aside, then renamed into place: a reader never sees half a bundle. The aside
    // directory is this call's own: two slots of one worker materialise the same bundle at
    // once (a per-process name let one rename it away while the other was still writing).
    let partial = cache.join(format!(
        ".{digest}-{}-{:016x}",
        std::process::id(),
        rand::random::<u64>()
    ));
    for asset in &response.assets {
        let relative = Path::new(&asset.path);
        if !relative
            .components()
            .all(|component| matches!(component, Component::Normal(_)))
        {
            return Err(Error::Assets(format!("plan asset path `{}`", asset.path)));
        }
        let path = partial.join(relative);
        if let Some(parent) = path.parent() {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(|err| io(parent, err))?;
        }
        tokio::fs::write(&path, &asset.content)
            .await
            .map_err(|err| io(&path, err))?;
        if asset.executable {
            use std::os::unix::fs::PermissionsExt;
            tokio::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
                .await
                .map_err(|err| io(&path, err))?;
        }
    }
    tokio::fs::create_dir_all(&partial)
        .await
        .map_err(|err| io(&partial, err))?;
    match tokio::fs::rename(&partial, &dir).await {
        Ok(()) => {}
        // Another task materialised the same bundle first: use theirs.
        Err(_) if dir.exists() => {
            let _ = tokio::fs::remove_dir_all(&partial).await;
        }
        Err(err) => return Err(io(&dir, err)),
    }
    tracing::info!(digest, files = response.assets.len(), dir = %dir.display(), "plan assets materialised");
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asset(path: &str, content: &str) -> PlanAsset {
        PlanAsset {
            path: path.to_owned(),
            content: content.as_bytes().to_vec(),
            executable: false,
        }
    }

    #[test]
    fn bundles_are_sorted_checked_and_named_by_content() {
        let (a, _) = bundle(vec![asset("b.py", "b"), asset("agents/a.py", "a")]).expect("ok");
        let (b, _) = bundle(vec![asset("agents/a.py", "a"), asset("b.py", "b")]).expect("ok");
        assert_eq!(a, b, "order does not change the digest");
        let (c, _) = bundle(vec![asset("agents/a.py", "A"), asset("b.py", "b")]).expect("ok");
        assert_ne!(a, c);
        for bad in ["../x", "/etc/passwd", "", "a/../../b", "a\\b"] {
            assert!(bundle(vec![asset(bad, "x")]).is_err(), "{bad}");
        }
        assert!(bundle(vec![asset("a", "1"), asset("a", "2")]).is_err());
        let big = PlanAsset {
            path: "big".to_owned(),
            content: vec![0; MAX_BYTES + 1],
            executable: false,
        };
        assert!(bundle(vec![big]).unwrap_err().contains("MiB"));
    }
}
