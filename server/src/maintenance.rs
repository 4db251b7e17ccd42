//! Background work beside the API: the reaper that deletes expired records,
//! and the gauges that watch the table and the connection pool. Correctness
//! never depends on any of it: expired records already act as absent.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::PgPool;

use crate::{
    metrics::{
        DB_POOL_CONNECTIONS, DB_POOL_MAX_CONNECTIONS, REAPER_BACKLOG_SECONDS,
        REAPER_DURATION_SECONDS, REAPER_LAST_SUCCESS_TIMESTAMP_SECONDS, REAPER_RUNS_TOTAL, RECORDS,
        TABLE_BYTES,
    },
    store::{
        StoreResult,
        reaper::{self, ReapLimits, ReapReport},
        stats,
    },
};

/// How the in-process reaper runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReaperSettings {
    /// Time between runs (on every replica; only the lock holder deletes).
    pub interval: Duration,
    pub limits: ReapLimits,
}

/// The flags' defaults (`settings.rs`'s tests keep the two equal).
impl Default for ReaperSettings {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(60),
            limits: ReapLimits::default(),
        }
    }
}

/// One reaper run, with its metrics and log line. Used by the in-process
/// loop and by `idempotencyd reap --once`.
pub async fn reap(pool: &PgPool, limits: &ReapLimits) -> StoreResult<ReapReport> {
    let started = std::time::Instant::now();
    let report = reaper::reap_once(pool, limits).await;
    match &report {
        Ok(ReapReport::Reaped { deleted, batches }) => {
            let elapsed = started.elapsed();
            metrics::counter!(REAPER_RUNS_TOTAL, "result" => "success").increment(1);
            metrics::histogram!(REAPER_DURATION_SECONDS).record(elapsed.as_secs_f64());
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default();
            metrics::gauge!(REAPER_LAST_SUCCESS_TIMESTAMP_SECONDS).set(now.as_secs_f64());
            tracing::info!(
                deleted,
                batches,
                elapsed_ms = elapsed.as_millis() as u64,
                "reaper run"
            );
        }
        Ok(ReapReport::Skipped) => {
            metrics::counter!(REAPER_RUNS_TOTAL, "result" => "skipped").increment(1);
            tracing::debug!("reaper skipped: another replica holds the lock");
        }
        Err(error) => {
            metrics::counter!(REAPER_RUNS_TOTAL, "result" => "error").increment(1);
            metrics::histogram!(REAPER_DURATION_SECONDS).record(started.elapsed().as_secs_f64());
            tracing::warn!(error = ?error, "reaper run failed");
        }
    }
    report
}

/// Reaps every `interval` until aborted.
///
/// A run that stopped at its cap left expired rows behind, so the next run
/// starts at once rather than an interval later: waiting would bound the
/// reaper at `max_per_run / interval` rows/s (16,700 at the default cap and
/// interval) however short its pauses (docs/performance.md, "Cleanup under
/// load").
/// The cap still ends the run, so the lock and its connection are given back
/// between runs.
pub async fn run_reaper(pool: PgPool, settings: ReaperSettings) {
    let mut ticker = tokio::time::interval(settings.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        // Errors are counted and logged in `reap`; the next tick tries again.
        let report = reap(&pool, &settings.limits).await;
        if stopped_at_cap(&report, &settings.limits) {
            ticker.reset_immediately();
        }
    }
}

fn stopped_at_cap(report: &StoreResult<ReapReport>, limits: &ReapLimits) -> bool {
    matches!(report, Ok(ReapReport::Reaped { deleted, .. }) if *deleted >= limits.max_per_run)
}

/// Refreshes the table gauges every `interval` until aborted.
pub async fn watch_table(pool: PgPool, interval: Duration) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        match stats::table_stats(&pool).await {
            Ok(stats) => {
                metrics::gauge!(TABLE_BYTES).set(stats.total_bytes as f64);
                metrics::gauge!(REAPER_BACKLOG_SECONDS).set(stats.reaper_backlog_seconds);
                for state in ["in_progress", "completed", "failed", "released"] {
                    let rows = stats.rows_by_state.get(state).copied().unwrap_or(0.0);
                    metrics::gauge!(RECORDS, "state" => state).set(rows);
                }
            }
            Err(error) => tracing::debug!(error = ?error, "table statistics unavailable"),
        }
    }
}

/// Publishes the pool's connection counts every `interval` until aborted.
pub async fn watch_pool(pool: PgPool, interval: Duration) {
    let mut ticker = tokio::time::interval(interval);
    loop {
        ticker.tick().await;
        metrics::gauge!(DB_POOL_MAX_CONNECTIONS)
            .set(f64::from(pool.options().get_max_connections()));
        let open = pool.size();
        let idle = u32::try_from(pool.num_idle()).unwrap_or(open);
        metrics::gauge!(DB_POOL_CONNECTIONS, "state" => "idle").set(f64::from(idle));
        metrics::gauge!(DB_POOL_CONNECTIONS, "state" => "in_use")
            .set(f64::from(open.saturating_sub(idle)));
    }
}
