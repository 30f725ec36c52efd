//! SQLite's WAL checkpoints, kept off the writer. By default SQLite checkpoints inside the
//! commit that takes the WAL past 1,000 pages: the writer copies those pages into the database
//! and syncs both files while every other write waits behind it (on the group commit's lane).
//! Here the writer never checkpoints on its own (`wal_autocheckpoint = 0`); a task with a
//! connection of its own copies and syncs in the background (`PASSIVE`, which waits for no
//! one). Such a checkpoint cannot catch up with a busy writer, and the WAL only starts over
//! once all of it is copied, so when it grows past [`RESTART_PAGES`] the writer's next lease
//! first checkpoints what is left ([`Checkpoints`]'s `due`): a few pages, and the next
//! write starts the WAL over. Crash safety is SQLite's either way: a checkpoint copies only
//! what the WAL already holds, under the same `synchronous = NORMAL`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use sqlx::{AnyConnection, Connection as _, Row as _};

use crate::Error;

/// How often the background checkpoint runs while there are writes.
const EVERY: Duration = Duration::from_millis(100);

/// WAL pages (4 KiB each by default) past which the writer finishes a checkpoint so that the
/// WAL starts over: it stays within about this size plus what a tenth of a second writes.
pub(super) const RESTART_PAGES: i64 = 4096;

/// What the writer and the background checkpoint share.
#[derive(Debug, Default)]
pub(super) struct Checkpoints {
    /// Leases of the writer so far: no new lease, nothing new to copy.
    leases: AtomicU64,
    /// The WAL grew past [`RESTART_PAGES`]: the writer's next lease checkpoints first.
    due: AtomicBool,
}

impl Checkpoints {
    /// Counts a lease of the writer; true when it must checkpoint first (once per time due).
    pub(super) fn leased(&self) -> bool {
        self.leases.fetch_add(1, Ordering::Relaxed);
        self.due.swap(false, Ordering::Relaxed)
    }
}

/// Runs `PRAGMA wal_checkpoint(PASSIVE)` on `conn` and returns the WAL's size in pages
/// (-1 outside WAL mode).
pub(super) async fn checkpoint(conn: &mut AnyConnection) -> Result<i64, Error> {
    let row = sqlx::query("PRAGMA wal_checkpoint(PASSIVE)")
        .fetch_one(conn)
        .await?;
    Ok(row.try_get::<i64, _>(1)?)
}

/// Starts the background checkpoint of the database at `url` (its connection set up with
/// `setup`); it ends once `alive` (the writer) is gone.
pub(super) async fn start<T: Send + Sync + 'static>(
    url: &str,
    setup: &str,
    alive: Weak<T>,
    shared: Arc<Checkpoints>,
) -> Result<(), Error> {
    let mut conn = AnyConnection::connect(url).await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(setup.to_owned()))
        .execute(&mut conn)
        .await?;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut seen = 0;
        loop {
            tick.tick().await;
            if alive.strong_count() == 0 {
                break;
            }
            let leases = shared.leases.load(Ordering::Relaxed);
            if leases == seen {
                continue;
            }
            seen = leases;
            match checkpoint(&mut conn).await {
                Ok(pages) if pages >= RESTART_PAGES => shared.due.store(true, Ordering::Relaxed),
                Ok(_) => {}
                Err(err) => tracing::warn!(error = %err, "background checkpoint failed"),
            }
        }
        let _ = conn.close().await;
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::RESTART_PAGES;
    use crate::store::Store;

    /// Written by each call below (bytes): a hundred pages.
    const CHUNK: i64 = 400_000;

    /// The writer never checkpoints on its own, and yet the WAL stays bounded under a steady
    /// stream of writes: the background checkpoint copies it into the database, and once it
    /// grew past its bound the writer finishes the checkpoint so that it starts over. Nothing
    /// written is lost on the way, as a reopened store reads.
    #[tokio::test]
    async fn the_wal_stays_bounded_without_the_writer_checkpointing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("troupe.db");
        let wal = dir.path().join("troupe.db-wal");
        let store = Store::open_file(&path).await.unwrap();
        let mut tx = store.autocommit().await.unwrap();
        let auto: i64 = sqlx::query_scalar("PRAGMA wal_autocheckpoint")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert_eq!(auto, 0, "the writer does not checkpoint on its own");
        sqlx::query("CREATE TABLE scratch (b BLOB)")
            .execute(&mut *tx)
            .await
            .unwrap();
        drop(tx);

        // Four times the bound, in calls of a hundred pages, ten a tick of the background
        // checkpoint.
        let bound = RESTART_PAGES * 4096;
        let calls = 4 * bound / CHUNK;
        let mut largest = 0;
        for _ in 0..calls {
            let mut tx = store.autocommit().await.unwrap();
            sqlx::query("INSERT INTO scratch VALUES (randomblob($1))")
                .bind(CHUNK)
                .execute(&mut *tx)
                .await
                .unwrap();
            drop(tx);
            largest = largest.max(std::fs::metadata(&wal).unwrap().len() as i64);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let written = calls * CHUNK;
        assert!(
            largest < written / 2,
            "the WAL started over: at most {largest} bytes, of {written} written"
        );
        assert!(
            std::fs::metadata(&path).unwrap().len() as i64 >= written / 2,
            "the checkpoints copied the WAL into the database"
        );

        store.close().await;
        let store = Store::open_file(&path).await.unwrap();
        let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM scratch")
            .fetch_one(&store.reader)
            .await
            .unwrap();
        assert_eq!(rows, calls);
    }
}
