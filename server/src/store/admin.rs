//! Queries behind `idempotencyd admin`: for operators and support, not the hot path.

use std::time::Duration;

use sqlx::PgPool;

use super::{RecordRow, Store, StoreResult};
use crate::domain::{RecordFilter, RecordId, Timestamp};

/// Deletes one record whatever its state, so that its key is free at once.
/// `false`: there was none.
pub async fn purge(pool: &PgPool, id: &RecordId) -> StoreResult<bool> {
    let result = sqlx::query(
        "DELETE FROM idempotency_records
         WHERE namespace = $1 AND operation = $2 AND subject = $3 AND key = $4",
    )
    .bind(id.namespace())
    .bind(id.operation())
    .bind(id.subject())
    .bind(id.key())
    .execute(pool)
    .await?;
    Ok(result.rows_affected() > 0)
}

/// The records a filter matches ($1 to $4); each part left out matches any
/// value. A macro, so that the statements stay `&'static str`.
macro_rules! matching {
    () => {
        "namespace = $1
         AND ($2::text IS NULL OR operation = $2)
         AND ($3::text IS NULL OR subject = $3)
         AND ($4::text IS NULL OR key = $4)"
    };
}

/// How many records match, whatever their state, and the database time of
/// the count: [`purge_matching`] deletes only records created by then, so
/// records created while the operator confirms are not deleted unseen.
pub async fn count_matching(pool: &PgPool, filter: &RecordFilter) -> StoreResult<(u64, Timestamp)> {
    let (count, counted_at): (i64, Timestamp) = sqlx::query_as(concat!(
        "SELECT count(*), now() FROM idempotency_records WHERE ",
        matching!()
    ))
    .bind(filter.namespace())
    .bind(filter.operation())
    .bind(filter.subject())
    .bind(filter.key())
    .fetch_one(pool)
    .await?;
    Ok((count.try_into().unwrap_or(0), counted_at))
}

/// How a purge of many records deletes: short statements, with room for
/// live traffic between them (as the reaper does).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PurgeLimits {
    /// Rows per DELETE statement.
    pub batch_size: u32,
    /// Pause after a full batch.
    pub batch_pause: Duration,
}

impl Default for PurgeLimits {
    fn default() -> Self {
        Self {
            batch_size: 1000,
            batch_pause: Duration::from_millis(50),
        }
    }
}

/// Deletes the records a filter matches that were created at or before
/// `created_by`, whatever their state, in batches until none is left.
/// `deleted` counts rows as batches commit, so it is right after an error too.
pub async fn purge_matching(
    pool: &PgPool,
    filter: &RecordFilter,
    created_by: Timestamp,
    limits: &PurgeLimits,
    deleted: &mut u64,
) -> StoreResult<()> {
    // The outer conditions re-check the row as locked (an Acquire may have
    // started a new lifetime of an expired key meanwhile).
    const SQL: &str = concat!(
        "DELETE FROM idempotency_records
         WHERE (namespace, operation, subject, key) IN (
             SELECT namespace, operation, subject, key
             FROM idempotency_records
             WHERE created_at <= $5 AND ",
        matching!(),
        " LIMIT $6)
           AND created_at <= $5 AND ",
        matching!()
    );
    let batch_size = limits.batch_size.max(1);
    loop {
        let rows = sqlx::query(SQL)
            .bind(filter.namespace())
            .bind(filter.operation())
            .bind(filter.subject())
            .bind(filter.key())
            .bind(created_by)
            .bind(i64::from(batch_size))
            .execute(pool)
            .await?
            .rows_affected();
        *deleted += rows;
        // A short batch may have raced the reaper or another purge: go on
        // until a statement finds nothing.
        if rows == 0 {
            return Ok(());
        }
        if rows >= u64::from(batch_size) {
            tokio::time::sleep(limits.batch_pause).await;
        }
    }
}

/// Reads a record, expired or not, with the size of its stored response.
pub async fn get(pool: &PgPool, id: &RecordId) -> StoreResult<Option<(RecordRow, i64)>> {
    let row = Store::new(pool.clone()).read(id).await?;
    Ok(row.map(|row| {
        let size = row.response().ok().flatten().map_or(0, |r| r.size() as i64);
        (row, size)
    }))
}

/// An in-progress record whose lease passed without a takeover.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct StuckRecord {
    pub namespace: String,
    pub operation: String,
    pub subject: String,
    pub key: String,
    pub fencing_token: i64,
    pub lease_expires_at: Timestamp,
    pub created_at: Timestamp,
    pub expires_at: Timestamp,
}

/// In-progress records whose lease expired more than `older_than` ago, oldest first.
pub async fn stuck(
    pool: &PgPool,
    older_than: std::time::Duration,
    limit: i64,
) -> StoreResult<Vec<StuckRecord>> {
    let rows = sqlx::query_as::<_, StuckRecord>(
        "SELECT namespace, operation, subject, key, fencing_token, lease_expires_at, created_at, expires_at
         FROM idempotency_records
         WHERE state = 'in_progress' AND lease_expires_at < now() - $1::interval AND expires_at > now()
         ORDER BY lease_expires_at
         LIMIT $2",
    )
    .bind(super::interval(older_than))
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(rows)
}

/// Record counts per namespace and state.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct NamespaceCount {
    pub namespace: String,
    pub state: String,
    /// Live records (not expired).
    pub live: i64,
    /// Expired records cleanup has not deleted yet.
    pub expired: i64,
}

/// Exact counts: this scans the table, so it is for operators, not for scrapes.
pub async fn counts(pool: &PgPool) -> StoreResult<Vec<NamespaceCount>> {
    let rows = sqlx::query_as::<_, NamespaceCount>(
        "SELECT namespace, state,
                count(*) FILTER (WHERE expires_at > now()) AS live,
                count(*) FILTER (WHERE expires_at <= now()) AS expired
         FROM idempotency_records
         GROUP BY namespace, state
         ORDER BY namespace, state",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows)
}
