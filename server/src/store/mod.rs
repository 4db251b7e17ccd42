//! The only place with SQL. Every statement is a single autocommit round trip;
//! no transaction stays open across a caller's business logic. Every time is
//! the database's `now()`, so replicas of the service agree on leases.
//!
//! This module (reads, Release, Renew) and [`records`] (Acquire, Complete,
//! terminal Fail, whose SQL is in [`statements`]) hold the records' hot
//! path; [`batch`] lets concurrent calls share statements. [`reaper`]
//! deletes expired records, [`stats`] reads the table's size, [`admin`]
//! serves the operator CLI.
//!
//! # Plans: keys and the `expires_at` index, never the whole table
//!
//! Every statement of the service finds its rows by primary key, or (the
//! reaper, the gauges' oldest expiry) through the `expires_at` index. The
//! danger is a young table: on a table that has rows but no statistics yet,
//! the planner may prefer reading the whole table, and a prepared statement
//! keeps its generic plan until the next ANALYZE, however much the table
//! grows meanwhile. The serving pool's sessions use generic plans from the
//! first run (`plan_cache_mode = force_generic_plan`: Postgres's default
//! planned the batched Complete anew on every call, as its cost estimate for
//! one row beat the generic plan's for ten, which cost a quarter of a
//! millisecond per Complete). Three guards keep the plans on the indexes:
//!
//! - the serving pool's sessions plan with `enable_seqscan` and
//!   `enable_bitmapscan` off ([`crate::db::PoolSettings::index_lookups_only`]);
//!   the gauges' exact row count of a small table, which no index can
//!   answer, is the one statement that still scans ([`stats`]);
//! - the batched Complete writes its expiry check `(r.expires_at > now()) IS
//!   TRUE`, which no index can serve: with the check written plainly, the
//!   planner guessed that it keeps a third of a young table's rows and read
//!   them all through the `expires_at` index rather than look each key up
//!   ([`statements`], `finish`);
//! - the `expires_at` index itself (the first migration), so that the
//!   reaper and the gauges walk it instead of scanning.
//!
//! `tests/tests/contract/plans.rs` holds them: on a young table with
//! autovacuum off, it runs the hot path (Acquire, Complete, replay, a
//! takeover, Renew, Get) many times over, then checks that
//! no row was read by a sequential scan and that the `expires_at` index was
//! not walked beyond a few rows.

pub mod admin;
pub mod batch;
pub mod reaper;
mod records;
mod replay_share;
mod statements;
pub mod stats;

pub use records::{AcquireAttempt, AcquireInput, FinishInput};
pub use replay_share::LoneAcquire;
/// The batch statements' text, their key order and their row wait, for the
/// load generator's floor (`bench/src/floor.rs`), which runs them with none
/// of the service around them.
pub use statements::{
    FINISH as BATCH_FINISH_SQL, INSERT_OR_READ as BATCH_INSERT_OR_READ_SQL, KeyOrder,
    batch_lock_timeout,
};

use std::{
    collections::BTreeMap,
    sync::{Arc, OnceLock},
    time::Duration,
};

use sqlx::{
    PgConnection, PgPool, Postgres, pool::PoolConnection, postgres::types::PgInterval, types::Json,
};

use crate::{
    domain::{FencingToken, Fingerprint, RecordId, RecordState, StoredResponse, Timestamp},
    metrics::{DB_POOL_WAIT_SECONDS, query},
};

/// A failed statement, sorted by what the caller can do about it.
#[derive(Debug, thiserror::Error, Clone)]
pub enum StoreError {
    /// The database is unreachable, overloaded or restarting: retrying later may succeed.
    /// (Shared: one failed batch statement fails every call in it, unless
    /// the failure [concerns its rows](Self::concerns_rows).)
    #[error("database unavailable")]
    Unavailable(#[source] Arc<sqlx::Error>),
    /// Anything else: a bug or a broken schema.
    #[error("database error")]
    Internal(#[source] Arc<sqlx::Error>),
    /// A row holds a value the schema's checks should have refused.
    #[error("corrupt row: {0}")]
    Corrupt(String),
}

impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> Self {
        if is_transient(&error) {
            Self::Unavailable(Arc::new(error))
        } else {
            Self::Internal(Arc::new(error))
        }
    }
}

impl StoreError {
    /// The statement failed for its rows' sake, not the database's: a row
    /// lock it waited for too long (55P03), a serialization failure
    /// (40001) or a deadlock (40P01). Another statement over other rows
    /// would have succeeded, so a batch that fails so is run again call by
    /// call (see [`batch`]).
    pub fn concerns_rows(&self) -> bool {
        let Self::Unavailable(error) = self else {
            return false;
        };
        let sqlx::Error::Database(error) = &**error else {
            return false;
        };
        error
            .code()
            .is_some_and(|code| matches!(&*code, "55P03" | "40001" | "40P01"))
    }

    /// No answer from the database within `bound`.
    fn timed_out(bound: Duration) -> Self {
        Self::Unavailable(Arc::new(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("the database did not answer within {bound:?}"),
        ))))
    }
}

/// Errors that say nothing about the request, only about the database's health.
fn is_transient(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            // 08: connection exception; 53: insufficient resources; 58: system
            // error (I/O); 57P0x: shutdown or restart; 57014: statement timeout
            // or cancel; 40001/40P01: serialization failure or deadlock;
            // 55P03: lock timeout; 25006: read-only transaction (a failover
            // left us on a standby until the connection is replaced).
            // 28: our role may not log in (a password rotated in Postgres
            // before the service's secret); 3D000: our database is missing;
            // 42501: our role lost a privilege. Those are the operator's to
            // fix, not the caller's: until then the service is unavailable,
            // so clients back off (or fail open) instead of treating it as a
            // bug of their request.
            code.starts_with("08")
                || code.starts_with("28")
                || matches!(&*code, "3D000" | "42501")
                || code.starts_with("53")
                || code.starts_with("58")
                || code.starts_with("57P0")
                || matches!(&*code, "57014" | "40001" | "40P01" | "55P03" | "25006")
        }),
        // Protocol errors and the rest are bugs: retrying would not help.
        _ => false,
    }
}

pub type StoreResult<T> = Result<T, StoreError>;

/// What a successful Acquire statement returns.
#[derive(Debug, sqlx::FromRow)]
pub struct AcquiredRow {
    fencing_token: i64,
    pub lease_expires_at: Timestamp,
    pub expires_at: Timestamp,
    previous_state: Option<String>,
}

impl AcquiredRow {
    /// A record this statement created: a new token, no previous state.
    pub(crate) fn inserted(
        fencing_token: i64,
        lease_expires_at: Timestamp,
        expires_at: Timestamp,
    ) -> Self {
        Self {
            fencing_token,
            lease_expires_at,
            expires_at,
            previous_state: None,
        }
    }

    pub fn fencing_token(&self) -> FencingToken {
        // The schema keeps tokens positive.
        self.fencing_token as FencingToken
    }

    /// True when this Acquire took over an attempt whose lease had passed
    /// (not a released key, not an expired record).
    pub fn took_over_lapsed_lease(&self) -> bool {
        self.previous_state.as_deref() == Some(RecordState::InProgress.as_str())
    }
}

/// A record as stored, with the database clock's view of it.
#[derive(Debug, sqlx::FromRow)]
pub struct RecordRow {
    pub state: String,
    pub fingerprint: Vec<u8>,
    pub fencing_token: i64,
    pub created_at: Timestamp,
    pub expires_at: Timestamp,
    pub lease_expires_at: Option<Timestamp>,
    pub completed_at: Option<Timestamp>,
    pub response_status: Option<i32>,
    pub response_body: Option<Vec<u8>>,
    pub response_headers: Option<Json<BTreeMap<String, String>>>,
    /// `now()` at the time of the read.
    pub db_now: Timestamp,
}

impl RecordRow {
    pub fn state(&self) -> StoreResult<RecordState> {
        RecordState::from_stored(&self.state)
            .ok_or_else(|| StoreError::Corrupt(format!("unknown state {:?}", self.state)))
    }

    pub fn fencing_token(&self) -> FencingToken {
        // The schema keeps tokens positive.
        self.fencing_token as FencingToken
    }

    pub fn fingerprint(&self) -> Fingerprint {
        Fingerprint::from_stored(self.fingerprint.clone())
    }

    /// An expired row acts as absent until cleanup removes it.
    pub fn is_expired(&self) -> bool {
        self.expires_at <= self.db_now
    }

    pub fn lease_is_live(&self) -> bool {
        self.lease_expires_at
            .is_some_and(|lease| lease > self.db_now)
    }

    pub fn response(&self) -> StoreResult<Option<StoredResponse>> {
        let Some(status) = self.response_status else {
            return Ok(None);
        };
        let status_code = u32::try_from(status)
            .map_err(|_| StoreError::Corrupt(format!("negative status {status}")))?;
        Ok(Some(StoredResponse {
            status_code,
            body: self.response_body.clone().unwrap_or_default(),
            headers: self
                .response_headers
                .as_ref()
                .map(|json| json.0.clone())
                .unwrap_or_default(),
        }))
    }
}

/// Handle to the records table.
#[derive(Clone)]
pub struct Store {
    db: Db,
    /// Group commit for Acquire and Complete/Fail; `None`: one statement per call.
    batchers: Option<Arc<records::Batchers>>,
    /// How often lone Acquires find their key, which chooses their statement.
    replays: Arc<replay_share::ReplayShare>,
}

/// The pool, and how long to wait for a statement's answer on its
/// connections: the pool's statement timeout plus [`STATEMENT_MARGIN`].
#[derive(Clone)]
struct Db {
    pool: PgPool,
    bound: Duration,
}

impl Db {
    fn new(pool: PgPool) -> Self {
        Self {
            bound: statement_bound(&pool),
            pool,
        }
    }

    /// A connection from the pool (see [`Connection`]), timing the wait for
    /// it. The wait is bounded by the pool's `acquire_timeout`, a new
    /// connection's handshake included, so a database that accepts
    /// connections but never answers still gives `PoolTimedOut` in time.
    async fn connection(&self) -> StoreResult<Connection> {
        let started = std::time::Instant::now();
        let connection = self.pool.acquire().await;
        pool_wait().record(started.elapsed().as_secs_f64());
        // No connection says nothing about the request, whatever the error:
        // during a failover a proxy with no primary behind it accepts and
        // closes connections, which sqlx reports as a protocol error (the
        // TLS negotiation's "unexpected response from SSLRequest").
        let connection = connection.map_err(|error| StoreError::Unavailable(Arc::new(error)))?;
        Ok(Connection {
            inner: Some(connection),
            in_statement: false,
            read_only: false,
            bound: self.bound,
        })
    }

    /// The connection in `kept` (a batch worker's, kept between its
    /// statements: giving one back to the pool costs a round trip, as sqlx
    /// checks it with a Sync, and a task), or a new one put there. Once the
    /// pool is closed (shutdown), a kept connection is closed too, not used.
    async fn kept<'k>(&self, kept: &'k mut Option<Connection>) -> StoreResult<&'k mut Connection> {
        if self.pool.is_closed() {
            *kept = None;
        }
        if kept.is_none() {
            *kept = Some(self.connection().await?);
        }
        Ok(kept.as_mut().expect("a connection was just put there"))
    }
}

/// `idempotency_db_pool_wait_seconds`, registered once, not per call.
fn pool_wait() -> &'static metrics::Histogram {
    static POOL_WAIT: OnceLock<metrics::Histogram> = OnceLock::new();
    POOL_WAIT.get_or_init(|| crate::metrics::kept(|| metrics::histogram!(DB_POOL_WAIT_SECONDS)))
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("batching", &self.batchers.is_some())
            .finish_non_exhaustive()
    }
}

pub(crate) fn interval(duration: Duration) -> PgInterval {
    PgInterval {
        months: 0,
        days: 0,
        // Limits cap durations far below i64::MAX microseconds.
        microseconds: i64::try_from(duration.as_micros()).unwrap_or(i64::MAX),
    }
}

/// Postgres has no unsigned types; codes above i32::MAX are refused by validation
/// long before they get here, so saturating is only a guard.
pub(crate) fn status(response: &StoredResponse) -> i32 {
    i32::try_from(response.status_code).unwrap_or(i32::MAX)
}

pub(crate) fn token(token: FencingToken) -> i64 {
    i64::try_from(token).unwrap_or(i64::MAX)
}

/// How long the store waits for a statement's answer beyond Postgres' own
/// `statement_timeout`: the commit, which that timeout does not cover, and
/// the round trip.
pub const STATEMENT_MARGIN: Duration = Duration::from_secs(1);

/// A pool connection whose statements are bounded on the client side, and
/// that is closed instead of going back to the pool when a statement on it
/// did not end: cut short by the bound, or by its caller going away (a
/// dropped future). Postgres' `statement_timeout` never fires when the
/// database stops answering altogether (a frozen host, no TCP reset), and
/// sqlx gives a dropped connection back to the pool only after a ping that
/// waits for the unfinished statement's answer, holding a pool slot for as
/// long as the database is frozen, and then hands it to the next caller.
///
/// It is closed too when a statement on it was refused as a write in a
/// read-only session (25006): after a failover the connection may reach a
/// server that is now a standby (an old primary that came back, a DNS name
/// that still resolved to it). Given back to the pool it would refuse every
/// write until it idled out; closed, the next call opens a connection to
/// wherever the database URL leads now, normally the new primary.
pub(crate) struct Connection {
    /// `None` only once dropped.
    inner: Option<PoolConnection<Postgres>>,
    /// A statement was sent and its answer not yet read in full.
    in_statement: bool,
    /// The session refused a write: it is on a read-only server.
    read_only: bool,
    /// Longest wait for a statement's answer.
    bound: Duration,
}

impl Connection {
    /// Runs `statement` on this connection, waiting at most its bound for it.
    pub(crate) async fn run<'c, T, F>(
        &'c mut self,
        statement: impl FnOnce(&'c mut PgConnection) -> F,
    ) -> StoreResult<T>
    where
        F: Future<Output = Result<T, sqlx::Error>> + 'c,
    {
        let Self {
            inner,
            in_statement,
            read_only,
            bound,
        } = self;
        let bound = *bound;
        let connection = inner.as_mut().expect("a connection until dropped");
        *in_statement = true;
        let answer = tokio::time::timeout(bound, statement(connection)).await;
        // Timed out: `in_statement` stays set, so the connection is closed
        // when dropped.
        let answer = answer.map_err(|_| StoreError::timed_out(bound))?;
        *in_statement = false;
        if let Err(error) = &answer {
            *read_only |= is_read_only(error);
        }
        Ok(answer?)
    }
}

/// A write refused because the session is read-only: a standby (recovery)
/// or `default_transaction_read_only`.
fn is_read_only(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().as_deref() == Some("25006"))
}

impl Drop for Connection {
    fn drop(&mut self) {
        let Some(connection) = self.inner.take() else {
            return;
        };
        if self.in_statement {
            // Detached (the pool may open another in its place) and dropped:
            // the socket closes at once. `close_on_drop` would say goodbye
            // first, in a task holding the pool slot for up to 5 s when the
            // database does not read. Postgres ends the session when it
            // notices, at the latest when the statement it may still be
            // running ends.
            drop(connection.detach());
            metrics::counter!(crate::metrics::DB_CONNECTIONS_ABANDONED_TOTAL).increment(1);
        } else if self.read_only {
            // Out of the pool, its socket closed at once.
            drop(connection.detach());
            metrics::counter!(crate::metrics::DB_CONNECTIONS_READ_ONLY_TOTAL).increment(1);
        }
    }
}

/// How long to wait for a statement's answer on `pool`'s connections.
fn statement_bound(pool: &PgPool) -> Duration {
    crate::db::statement_timeout(&pool.connect_options())
        .unwrap_or(crate::db::PoolSettings::default().statement_timeout)
        + STATEMENT_MARGIN
}

impl Store {
    /// One statement per call.
    pub fn new(pool: PgPool) -> Self {
        Self {
            db: Db::new(pool),
            batchers: None,
            replays: Arc::default(),
        }
    }

    /// Concurrent Acquires, and concurrent Completes and terminal Fails,
    /// share statements (see [`batch`]).
    pub fn with_batching(pool: PgPool, settings: batch::BatchSettings) -> Self {
        let db = Db::new(pool);
        let replays = Arc::<replay_share::ReplayShare>::default();
        Self {
            batchers: Some(Arc::new(records::Batchers::spawn(
                &db,
                settings,
                replays.clone(),
            ))),
            db,
            replays,
        }
    }

    pub fn pool(&self) -> &PgPool {
        &self.db.pool
    }

    /// The statements an Acquire alone in its statement runs: it inserts
    /// first, as for new keys; reads first, in one statement that inserts
    /// when the key is absent, once lone Acquires lately found their key
    /// more often than about a quarter of the time (a replay, a duplicate);
    /// or reads alone, and inserts in a second statement when the key is
    /// absent, above 13/16. All answer the same; they differ in
    /// cost (see `docs/performance.md`).
    pub fn lone_acquire(&self) -> LoneAcquire {
        self.replays.lone_acquire()
    }

    /// Reads a record, expired or not, with the database's `now()`.
    pub async fn read(&self, id: &RecordId) -> StoreResult<Option<RecordRow>> {
        let _timer = query::READ.timer();
        let mut connection = self.db.connection().await?;
        statements::read(&mut connection, id).await
    }

    /// Gives the key back so the next Acquire takes it over. `false`: no live
    /// in-progress record is held with `fencing_token`.
    pub async fn release(&self, id: &RecordId, fencing_token: FencingToken) -> StoreResult<bool> {
        const SQL: &str = "
            UPDATE idempotency_records
            SET state = 'released', lease_expires_at = NULL
            WHERE namespace = $1 AND operation = $2 AND subject = $3 AND key = $4
              AND fencing_token = $5 AND state = 'in_progress' AND expires_at > now()";
        let _timer = query::RELEASE.timer();
        let query = sqlx::query(SQL)
            .bind(id.namespace())
            .bind(id.operation())
            .bind(id.subject())
            .bind(id.key())
            .bind(token(fencing_token));
        let mut connection = self.db.connection().await?;
        let result = connection
            .run(|connection| query.execute(connection))
            .await?;
        Ok(result.rows_affected() == 1)
    }

    /// Extends the lease held with `fencing_token`, moving the expiry forward
    /// when the lease would outlive it. `None`: no such in-progress record.
    pub async fn renew(
        &self,
        id: &RecordId,
        fencing_token: FencingToken,
        lease: Duration,
    ) -> StoreResult<Option<(Timestamp, Timestamp)>> {
        const SQL: &str = "
            UPDATE idempotency_records
            SET lease_expires_at = now() + $6::interval,
                expires_at = greatest(expires_at, now() + $6::interval)
            WHERE namespace = $1 AND operation = $2 AND subject = $3 AND key = $4
              AND fencing_token = $5 AND state = 'in_progress' AND expires_at > now()
            RETURNING lease_expires_at, expires_at";
        let _timer = query::RENEW.timer();
        let query = sqlx::query_as::<_, (Timestamp, Timestamp)>(SQL)
            .bind(id.namespace())
            .bind(id.operation())
            .bind(id.subject())
            .bind(id.key())
            .bind(token(fencing_token))
            .bind(interval(lease));
        let mut connection = self.db.connection().await?;
        connection
            .run(|connection| query.fetch_optional(connection))
            .await
    }
}
