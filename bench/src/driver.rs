//! `--driver-floor`: pgbench's own statements through sqlx alone, one at a
//! time on one connection, in a task on this process's runtime, with no
//! gRPC, no server and no other work: what the driver and tokio cost per
//! statement against pgbench (libpq) running the same statement on the same
//! database. The server's statement time beyond it is ours; this beyond
//! pgbench's is the driver's, the runtime's and their wake-ups
//! (`make bench-budget`).
//!
//! `select`: the primary-key read of `bench/pgbench/replay.sql`, over the
//! keys `replay_keys.sql` stored. `pair`: the new-key pair of
//! `new_key_pair.sql`, as the floor (`floor.rs`) runs it.

use std::time::{Duration, Instant};

use anyhow::Context;
use hdrhistogram::Histogram;
use serde_json::json;
use sqlx::{Connection, PgConnection, postgres::PgConnectOptions, types::Json};

use crate::floor::{INSERT, UPDATE};

/// What `--driver-floor` runs.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Work {
    Select,
    Pair,
}

/// `replay.sql`'s read, with the key as a parameter.
const SELECT: &str = "
    SELECT state, fingerprint, fencing_token, created_at, expires_at, lease_expires_at,
           completed_at, response_status, response_body, response_headers, now() AS db_now
    FROM idempotency_records
    WHERE namespace = 'bench' AND operation = 'POST /bench' AND subject = 'pgbench'
      AND key = $1";

type Timestamp = sqlx::types::chrono::DateTime<sqlx::types::chrono::Utc>;

/// What `--driver-floor` is asked to do.
pub struct Settings {
    pub work: Work,
    /// `select`: keys `replay-1` to `replay-{keys}`.
    pub keys: u64,
    pub warmup: Duration,
    pub duration: Duration,
    /// Idle time before each operation, not timed: the gap a service's
    /// statements have between them while the caller's call crosses gRPC.
    pub pause: Duration,
}

/// Runs the work for the warm-up, then for the duration, and prints one
/// JSON object: operations, their rate, and their latency in µs (mean and
/// percentiles).
pub async fn run(database: PgConnectOptions, settings: Settings) -> anyhow::Result<()> {
    let mut connection = PgConnection::connect_with(&database)
        .await
        .context("connecting to the database")?;
    let Settings { work, .. } = settings;
    timed(&mut connection, &settings, settings.warmup).await?;
    let (histogram, ran) = timed(&mut connection, &settings, settings.duration).await?;
    let ops = histogram.len();
    println!(
        "{}",
        json!({
            "work": format!("{work:?}").to_lowercase(),
            "pause_us": settings.pause.as_micros() as u64,
            "ops": ops,
            "ops_per_sec": ops as f64 / ran.as_secs_f64(),
            "latency_us": crate::stats::percentiles(&histogram),
        })
    );
    Ok(())
}

/// The work one operation at a time for `duration`: each one's latency in
/// µs, and how long they ran, pauses included.
async fn timed(
    connection: &mut PgConnection,
    settings: &Settings,
    duration: Duration,
) -> anyhow::Result<(Histogram<u64>, Duration)> {
    let mut histogram = Histogram::new(3).expect("a histogram of 3 significant digits");
    let started = Instant::now();
    while started.elapsed() < duration {
        if !settings.pause.is_zero() {
            // The thread sleeps, as a server's does between a caller's
            // statements (tokio's timers would round it up to a millisecond);
            // nothing else runs on this runtime meanwhile.
            std::thread::sleep(settings.pause);
        }
        let begun = Instant::now();
        match settings.work {
            Work::Select => {
                let key = format!("replay-{}", fastrand::u64(1..=settings.keys));
                let row: Option<ReplayRow> = sqlx::query_as(SELECT)
                    .bind(&key)
                    .fetch_optional(&mut *connection)
                    .await?;
                anyhow::ensure!(
                    row.is_some(),
                    "{key} is not stored: run replay_keys.sql first"
                );
            }
            Work::Pair => pair(connection).await?,
        }
        histogram.saturating_record(begun.elapsed().as_micros() as u64);
    }
    Ok((histogram, started.elapsed()))
}

/// The floor's Acquire and Complete statements for a new key.
async fn pair(connection: &mut PgConnection) -> anyhow::Result<()> {
    let key = format!("driver-{}", fastrand::u64(..));
    let fingerprint = [7u8; 32];
    let inserted: Option<(i64, Timestamp, Timestamp)> = sqlx::query_as(INSERT)
        .bind("bench")
        .bind("POST /bench")
        .bind("pgbench")
        .bind(&key)
        .bind(&fingerprint[..])
        .fetch_optional(&mut *connection)
        .await?;
    let (token, ..) = inserted.context("a new key inserted nothing")?;
    let completed: Option<Timestamp> = sqlx::query_scalar(UPDATE)
        .bind("bench")
        .bind("POST /bench")
        .bind("pgbench")
        .bind(&key)
        .bind(token)
        .bind(201)
        .bind(vec![b'x'; 256])
        .bind(Json(std::collections::HashMap::<String, String>::new()))
        .fetch_optional(&mut *connection)
        .await?;
    completed.context("the update matched nothing")?;
    Ok(())
}

/// `SELECT`'s row, decoded as the server decodes a record.
#[derive(sqlx::FromRow)]
#[allow(dead_code)] // decoded for the cost of it, not read
struct ReplayRow {
    state: String,
    fingerprint: Vec<u8>,
    fencing_token: i64,
    created_at: Timestamp,
    expires_at: Timestamp,
    lease_expires_at: Option<Timestamp>,
    completed_at: Option<Timestamp>,
    response_status: Option<i32>,
    response_body: Option<Vec<u8>>,
    response_headers: Option<Json<std::collections::BTreeMap<String, String>>>,
    db_now: Timestamp,
}
