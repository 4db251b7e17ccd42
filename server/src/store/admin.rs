//! Queries behind `idempotencyd admin`: for operators and support, not the hot path.

use sqlx::PgPool;

use super::{RecordRow, Store, StoreResult};
use crate::domain::{RecordId, Timestamp};

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
