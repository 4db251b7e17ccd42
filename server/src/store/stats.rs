//! Cheap facts about the records table, for gauges: its size, rows by state,
//! and how far cleanup lags. Nothing here scans a large table.

use std::collections::BTreeMap;

use sqlx::PgPool;

use super::StoreResult;
use crate::metrics::query;

/// Below this many pages (8 KiB each, so 8 MiB) rows are counted exactly;
/// above, they are estimated from planner statistics.
const EXACT_COUNT_MAX_PAGES: i64 = 1024;

#[derive(Debug, Clone, PartialEq)]
pub struct TableStats {
    /// Table, indexes and TOAST, in bytes.
    pub total_bytes: i64,
    /// Rows by state (exact when small, else estimated).
    pub rows_by_state: BTreeMap<String, f64>,
    /// Seconds since the oldest unreaped record expired; 0 when none has.
    pub reaper_backlog_seconds: f64,
}

pub async fn table_stats(pool: &PgPool) -> StoreResult<TableStats> {
    let _timer = query::TABLE_STATS.timer();
    // The page count from the file size: relpages is 0 until the first ANALYZE.
    let (total_bytes, pages, reltuples, reaper_backlog_seconds): (i64, i64, f32, f64) =
        sqlx::query_as(
            "SELECT pg_total_relation_size(c.oid), pg_relation_size(c.oid) / 8192, c.reltuples,
                    coalesce(extract(epoch FROM now() - (SELECT min(expires_at) FROM idempotency_records))::float8, 0)
             FROM pg_class c WHERE c.oid = 'idempotency_records'::regclass",
        )
        .fetch_one(pool)
        .await?;
    let rows_by_state = if pages < EXACT_COUNT_MAX_PAGES {
        sqlx::query_as::<_, (String, i64)>(
            "SELECT state, count(*) FROM idempotency_records GROUP BY state",
        )
        .fetch_all(pool)
        .await?
        .into_iter()
        .map(|(state, count)| (state, count as f64))
        .collect()
    } else {
        // The planner's most common values of `state` and their frequencies,
        // refreshed by autovacuum's ANALYZE.
        let frequencies: Option<(Vec<String>, Vec<f32>)> = sqlx::query_as(
            "SELECT most_common_vals::text::text[], most_common_freqs
             FROM pg_stats
             WHERE schemaname = current_schema() AND tablename = 'idempotency_records' AND attname = 'state'",
        )
        .fetch_optional(pool)
        .await?;
        frequencies
            .map(|(states, freqs)| {
                states
                    .into_iter()
                    .zip(freqs)
                    .map(|(state, freq)| (state, f64::from(freq) * f64::from(reltuples)))
                    .collect()
            })
            .unwrap_or_default()
    };
    Ok(TableStats {
        total_bytes,
        rows_by_state,
        reaper_backlog_seconds: reaper_backlog_seconds.max(0.0),
    })
}
