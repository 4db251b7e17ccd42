//! Deleting expired records: in batches, each a short statement that walks
//! the `expires_at` index, skipping rows another statement has locked, so it
//! never holds long locks, never waits, and never scans the table.

use std::time::Duration;

use sqlx::{Connection, PgConnection, PgPool};

use super::{StoreError, StoreResult};
use crate::metrics::{REAPER_DELETED_TOTAL, query};

/// Session advisory lock that makes one replica the reaper; the others skip.
/// The number is arbitrary but fixed: every version of the service must agree.
const REAPER_LOCK: i64 = 0x6964_656d_7265_6170; // "idemreap"

/// How a run deletes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReapLimits {
    /// Rows per DELETE statement.
    pub batch_size: u32,
    /// Pause between batches, leaving the database room for live traffic.
    pub batch_pause: Duration,
    /// Most rows one run deletes; the next run continues (at once, in the
    /// reaper loop: `maintenance::run_reaper`).
    pub max_per_run: u64,
}

impl Default for ReapLimits {
    fn default() -> Self {
        Self {
            batch_size: 1000,
            batch_pause: Duration::from_millis(50),
            max_per_run: 1_000_000,
        }
    }
}

/// What a run did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReapReport {
    /// This process held the lock and deleted `deleted` rows in `batches` statements.
    Reaped { deleted: u64, batches: u64 },
    /// Another process holds the reaper lock.
    Skipped,
}

/// Deletes expired records if no other process is reaping.
pub async fn reap_once(pool: &PgPool, limits: &ReapLimits) -> StoreResult<ReapReport> {
    // The lock lives in this session, so the whole run uses one connection of
    // its own, outside the pool: if the run is cut short, dropping the
    // connection closes the session and so releases the lock.
    //
    // Connecting waits no longer than a call waits for a pooled connection:
    // a database host that stopped answering must not hold the run (and a
    // CronJob's pod) for the system's TCP timeout, minutes.
    let options = pool.connect_options();
    let connect = PgConnection::connect_with(&options);
    let mut connection = tokio::time::timeout(pool.options().get_acquire_timeout(), connect)
        .await
        .map_err(|_| sqlx::Error::PoolTimedOut)??;
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(REAPER_LOCK)
        .fetch_one(&mut connection)
        .await?;
    if !locked {
        return Ok(ReapReport::Skipped);
    }
    let result = delete_batches(&mut connection, limits).await;
    // Closing the session releases the lock.
    let _ = connection.close().await;
    let (deleted, batches) = result?;
    Ok(ReapReport::Reaped { deleted, batches })
}

async fn delete_batches(
    connection: &mut PgConnection,
    limits: &ReapLimits,
) -> StoreResult<(u64, u64)> {
    // Rows locked by a concurrent Acquire (re-creating an expired key) are
    // skipped, not waited for; the outer condition re-checks expiry on the
    // row as locked.
    const SQL: &str = "
        DELETE FROM idempotency_records
        WHERE (namespace, operation, subject, key) IN (
            SELECT namespace, operation, subject, key
            FROM idempotency_records
            WHERE expires_at <= now()
            ORDER BY expires_at
            LIMIT $1
            FOR UPDATE SKIP LOCKED)
          AND expires_at <= now()";
    let batch_size = i64::from(limits.batch_size.max(1));
    let (mut deleted, mut batches) = (0u64, 0u64);
    while deleted < limits.max_per_run {
        let this_batch =
            batch_size.min(i64::try_from(limits.max_per_run - deleted).unwrap_or(i64::MAX));
        let rows = {
            let _timer = query::REAP.timer();
            sqlx::query(SQL)
                .bind(this_batch)
                .execute(&mut *connection)
                .await
                .map_err(StoreError::from)?
                .rows_affected()
        };
        // Counted per batch, so rows deleted before a later batch fails (a
        // statement timeout, a lost connection) still show as deleted.
        metrics::counter!(REAPER_DELETED_TOTAL).increment(rows);
        deleted += rows;
        batches += 1;
        if rows < this_batch as u64 {
            break; // Caught up.
        }
        tokio::time::sleep(limits.batch_pause).await;
    }
    Ok((deleted, batches))
}
