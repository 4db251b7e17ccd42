//! The hot path's statements: Acquire's insert-or-read and takeover, and
//! Complete / terminal Fail. The first and the last take any number of
//! calls at once, so concurrent calls share one statement and one commit.

use std::{sync::Arc, time::Duration};

use sqlx::{
    FromRow, PgPool, Postgres,
    postgres::{PgArguments, PgRow, types::PgInterval},
    query::QueryAs,
    types::Json,
};

use super::{
    AcquiredRow, Connection, RecordRow, Store, StoreResult,
    batch::{BatchSettings, Batchable, Batcher, Part},
    connection, interval, status, token,
};
use crate::{
    domain::{FencingToken, Fingerprint, RecordId, RecordState, StoredResponse, Timestamp},
    metrics::QueryTimer,
};

/// One Acquire as the store sees it.
#[derive(Debug)]
pub struct AcquireInput {
    pub id: RecordId,
    pub fingerprint: Fingerprint,
    pub ttl: Duration,
    pub lease: Duration,
}

impl Batchable for AcquireInput {
    fn record(&self) -> &RecordId {
        &self.id
    }
}

/// What the insert-or-read statement found for one Acquire.
#[derive(Debug)]
pub enum AcquireAttempt {
    /// This statement created the record: the caller holds it with a new token.
    Inserted(AcquiredRow),
    /// The record exists, as read by the same statement.
    Existing(RecordRow),
    /// Another statement created the record after this one's snapshot was
    /// taken, so it was neither inserted nor seen: ask again.
    Raced,
}

/// One Complete or terminal Fail as the store sees it.
#[derive(Debug)]
pub struct FinishInput {
    pub id: RecordId,
    pub fencing_token: FencingToken,
    /// `Completed` or `Failed`.
    pub state: RecordState,
    pub response: StoredResponse,
}

impl Batchable for FinishInput {
    fn record(&self) -> &RecordId {
        &self.id
    }
}

pub(super) struct Batchers {
    acquire: Batcher<AcquireInput, AcquireAttempt>,
    finish: Batcher<FinishInput, Option<Timestamp>>,
}

impl BatchSettings {
    /// Connections the batch workers may keep at once: one per worker, for
    /// Acquire and for Complete.
    pub fn kept_connections(&self) -> usize {
        2 * self.workers.max(1)
    }
}

/// How long a batch statement's rows may wait for a row another session
/// holds, before the statement fails (lock timeout, 55P03) and its calls
/// run again alone. Long enough for the usual wait, another statement's
/// commit of the same key; short enough that the other calls of the batch
/// are not held up noticeably.
pub const BATCH_ROW_WAIT: Duration = Duration::from_millis(100);

/// Whether a statement may wait for rows other sessions hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RowWait {
    /// A batch worker's statement: it never waits long for one call's row.
    Brief,
    /// A call alone, on a connection of its own: it waits up to the
    /// statement timeout, as any statement.
    Full,
}

impl Batchers {
    pub(super) fn spawn(pool: PgPool, bound: Duration, settings: BatchSettings) -> Self {
        let (acquire_pool, acquire_alone_pool, finish_alone_pool) =
            (pool.clone(), pool.clone(), pool.clone());
        Self {
            acquire: Batcher::spawn(
                "acquire",
                settings,
                move |kept, inputs| {
                    let pool = acquire_pool.clone();
                    async move {
                        let (kept, attempts) =
                            insert_or_read(&pool, bound, kept, &inputs, RowWait::Brief).await;
                        (
                            kept,
                            attempts.map(|a| a.into_iter().map(Part::Done).collect()),
                        )
                    }
                },
                move |input| {
                    let pool = acquire_alone_pool.clone();
                    async move {
                        let inputs = [input];
                        single(
                            insert_or_read(&pool, bound, None, &inputs, RowWait::Full)
                                .await
                                .1,
                        )
                    }
                },
            ),
            finish: Batcher::spawn(
                "finish",
                settings,
                move |kept, inputs| {
                    let pool = pool.clone();
                    async move { finish(&pool, bound, kept, &inputs, RowWait::Brief).await }
                },
                move |input| {
                    let pool = finish_alone_pool.clone();
                    async move {
                        let inputs = [input];
                        single_part(finish(&pool, bound, None, &inputs, RowWait::Full).await.1)
                    }
                },
            ),
        }
    }
}

impl Store {
    /// Creates the record, or reads it when it exists. One round trip, and
    /// no write at all when the record exists (a replay, a duplicate): only
    /// a new key costs a commit.
    pub async fn insert_or_read(&self, input: Arc<AcquireInput>) -> StoreResult<AcquireAttempt> {
        match &self.batchers {
            Some(batchers) => batchers.acquire.run(input).await,
            // Boxed: without batching the hot path is a statement per call
            // anyway, and the batched path's futures stay small.
            None => single(
                Box::pin(insert_or_read(
                    &self.pool,
                    self.bound,
                    None,
                    std::slice::from_ref(&input),
                    RowWait::Full,
                ))
                .await
                .1,
            ),
        }
    }

    /// Moves the live in-progress record held with `fencing_token` to
    /// `completed` or `failed` with its response. `None`: no such record.
    pub async fn finish(&self, input: Arc<FinishInput>) -> StoreResult<Option<Timestamp>> {
        match &self.batchers {
            Some(batchers) => batchers.finish.run(input).await,
            None => single_part(
                Box::pin(finish(
                    &self.pool,
                    self.bound,
                    None,
                    std::slice::from_ref(&input),
                    RowWait::Full,
                ))
                .await
                .1,
            ),
        }
    }

    /// Takes over a record that expired, was released, or whose lease passed
    /// (when the fingerprints agree). `None`: it is no longer takeable.
    pub async fn take_over(&self, input: &AcquireInput) -> StoreResult<Option<AcquiredRow>> {
        // READ COMMITTED re-checks the WHERE on the newest row version after
        // waiting for a concurrent writer, so of concurrent takeovers one wins.
        // A record never expires under a live lease: expires_at >= lease_expires_at.
        // An expired record starts a new lifetime with a token larger than any
        // of the old one's (see the migration defining the function): its old
        // holder may still be running.
        const SQL: &str = "
            UPDATE idempotency_records AS r SET
                state = 'in_progress',
                fingerprint = CASE WHEN r.expires_at <= now() OR r.fingerprint = ''
                                   THEN $5 ELSE r.fingerprint END,
                fencing_token = CASE WHEN r.expires_at <= now() THEN idempotency_lifetime_token()
                                     ELSE r.fencing_token + 1 END,
                created_at = CASE WHEN r.expires_at <= now() THEN now() ELSE r.created_at END,
                expires_at = CASE WHEN r.expires_at <= now()
                                  THEN now() + greatest($6::interval, $7::interval)
                                  ELSE greatest(r.expires_at, now() + $7::interval) END,
                lease_expires_at = now() + $7::interval,
                completed_at = NULL,
                response_status = NULL,
                response_body = NULL,
                response_headers = NULL,
                previous_state = CASE WHEN r.expires_at <= now() THEN NULL ELSE r.state END
            WHERE namespace = $1 AND operation = $2 AND subject = $3 AND key = $4
              AND (r.expires_at <= now()
                   OR ((r.state = 'released' OR (r.state = 'in_progress' AND r.lease_expires_at <= now()))
                       AND (r.fingerprint = $5 OR r.fingerprint = '' OR $5 = '')))
            RETURNING fencing_token, lease_expires_at, expires_at, previous_state";
        let _timer = QueryTimer::start("take_over");
        let query = sqlx::query_as::<_, AcquiredRow>(SQL)
            .bind(input.id.namespace())
            .bind(input.id.operation())
            .bind(input.id.subject())
            .bind(input.id.key())
            .bind(input.fingerprint.as_bytes())
            .bind(interval(input.ttl))
            .bind(interval(input.lease));
        let mut connection = self.connection().await?;
        connection
            .run(self.bound, |connection| query.fetch_optional(connection))
            .await
    }
}

fn single<T>(result: StoreResult<Vec<T>>) -> StoreResult<T> {
    result?
        .pop()
        .ok_or_else(|| super::StoreError::Corrupt("a statement answered no result".into()))
}

/// The one answer of a statement that waits for its rows, and so passes
/// none over.
fn single_part<T>(result: StoreResult<Vec<Part<T>>>) -> StoreResult<T> {
    match single(result)? {
        Part::Done(output) => Ok(output),
        Part::Alone => Err(super::StoreError::Corrupt(
            "a waiting statement passed its row over".into(),
        )),
    }
}

/// Positions of `records` in key order. Every statement touches its rows in
/// this order, so two concurrent statements sharing records wait for each
/// other instead of deadlocking.
fn key_order<'a>(records: impl Iterator<Item = &'a RecordId>) -> Vec<usize> {
    let records: Vec<&RecordId> = records.collect();
    let mut order: Vec<usize> = (0..records.len()).collect();
    order.sort_by(|&a, &b| sort_key(records[a]).cmp(&sort_key(records[b])));
    order
}

fn sort_key(id: &RecordId) -> (&str, &str, &str, &str) {
    (id.namespace(), id.operation(), id.subject(), id.key())
}

/// A row of the insert-or-read statement: which input, inserted or read.
#[derive(sqlx::FromRow)]
struct AttemptRow {
    ord: i64,
    inserted: bool,
    #[sqlx(flatten)]
    record: RecordRow,
}

/// A batch worker's connection, kept between its statements: giving one back
/// to the pool costs a round trip (sqlx checks it with a Sync) and a task.
type KeptConnection = Option<Connection>;

/// Runs `query` on the kept connection, or on one from the pool, within
/// `bound`, and hands the connection back to be kept. After an error it goes
/// back to the pool instead, which checks it before anyone uses it again; a
/// statement that did not end within `bound` closes it (see
/// [`Connection`]). Once the pool is closed (shutdown), a kept connection is
/// closed too, not used.
async fn fetch_all_on_kept<'q, O>(
    pool: &PgPool,
    bound: Duration,
    kept: KeptConnection,
    query: QueryAs<'q, Postgres, O, PgArguments>,
) -> (KeptConnection, StoreResult<Vec<O>>)
where
    O: Send + Unpin + for<'r> FromRow<'r, PgRow>,
{
    let kept = kept.filter(|_| !pool.is_closed());
    let mut connection = match kept {
        Some(connection) => connection,
        None => match connection(pool).await {
            Ok(connection) => connection,
            Err(error) => return (None, Err(error)),
        },
    };
    match connection
        .run(bound, |connection| query.fetch_all(connection))
        .await
    {
        Ok(rows) => (Some(connection), Ok(rows)),
        Err(error) => (None, Err(error)),
    }
}

async fn insert_or_read(
    pool: &PgPool,
    bound: Duration,
    kept: KeptConnection,
    inputs: &[Arc<AcquireInput>],
    wait: RowWait,
) -> (KeptConnection, StoreResult<Vec<AcquireAttempt>>) {
    // The insert skips existing keys without locking or writing them; the
    // second branch reads those with the statement's snapshot, which cannot
    // see this statement's own inserts (and so never reads a key twice). A key
    // committed by someone else after the snapshot is neither: `Raced`.
    //
    // The insert does not wait for a row another session merely locks (FOR
    // UPDATE, FOR KEY SHARE), but it does wait for another transaction that
    // inserted, updated or deleted a key it inserts (to know whether the key
    // will exist), until that one ends (tried on Postgres 15). In a batch
    // that wait is cut short: `$9` sets `lock_timeout` for this statement's
    // transaction, evaluated with the first input row, before any insert.
    // Locks on the table itself are taken before execution, so a table
    // lock (a migration, an operator's LOCK) still holds the whole
    // statement up to the statement timeout: that one is no single call's.
    // `$9` NULL keeps the session's setting.
    const SQL: &str = "
        WITH input AS (
            SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[],
                                 $6::interval[], $7::interval[], $8::int8[])
                WITH ORDINALITY AS v(namespace, operation, subject, key, fingerprint, ttl, lease, ord, pos)
            WHERE set_config('lock_timeout', coalesce($9, current_setting('lock_timeout')), true)
                  IS NOT NULL
        ), inserted AS (
            INSERT INTO idempotency_records
                (namespace, operation, subject, key, state, fingerprint, fencing_token,
                 created_at, expires_at, lease_expires_at)
            SELECT namespace, operation, subject, key, 'in_progress', fingerprint,
                   idempotency_lifetime_token(),
                   now(), now() + greatest(ttl, lease), now() + lease
            FROM input
            ORDER BY pos
            ON CONFLICT (namespace, operation, subject, key) DO NOTHING
            RETURNING namespace, operation, subject, key, state, fingerprint, fencing_token,
                      created_at, expires_at, lease_expires_at, completed_at,
                      response_status, response_body, response_headers
        )
        SELECT i.ord, true AS inserted, x.state, x.fingerprint, x.fencing_token, x.created_at,
               x.expires_at, x.lease_expires_at, x.completed_at, x.response_status,
               x.response_body, x.response_headers, now() AS db_now
        FROM input i JOIN inserted x USING (namespace, operation, subject, key)
        UNION ALL
        SELECT i.ord, false, r.state, r.fingerprint, r.fencing_token, r.created_at,
               r.expires_at, r.lease_expires_at, r.completed_at, r.response_status,
               r.response_body, r.response_headers, now()
        FROM input i JOIN idempotency_records r USING (namespace, operation, subject, key)
        WHERE NOT EXISTS (SELECT 1 FROM inserted x
                          WHERE (x.namespace, x.operation, x.subject, x.key)
                              = (i.namespace, i.operation, i.subject, i.key))";
    let order = key_order(inputs.iter().map(|input| &input.id));
    let column = |part: fn(&AcquireInput) -> &str| -> Vec<&str> {
        order.iter().map(|&i| part(&inputs[i])).collect()
    };
    let fingerprints: Vec<&[u8]> = order
        .iter()
        .map(|&i| inputs[i].fingerprint.as_bytes())
        .collect();
    let ttls: Vec<PgInterval> = order.iter().map(|&i| interval(inputs[i].ttl)).collect();
    let leases: Vec<PgInterval> = order.iter().map(|&i| interval(inputs[i].lease)).collect();
    let positions: Vec<i64> = order.iter().map(|&i| i as i64).collect();

    let _timer = QueryTimer::start("acquire");
    let query = sqlx::query_as::<_, AttemptRow>(SQL)
        .bind(column(|input| input.id.namespace()))
        .bind(column(|input| input.id.operation()))
        .bind(column(|input| input.id.subject()))
        .bind(column(|input| input.id.key()))
        .bind(fingerprints)
        .bind(ttls)
        .bind(leases)
        .bind(positions)
        .bind(match wait {
            RowWait::Brief => Some(format!("{}ms", BATCH_ROW_WAIT.as_millis())),
            RowWait::Full => None,
        });
    let (kept, rows) = fetch_all_on_kept(pool, bound, kept, query).await;
    (kept, rows.map(|rows| attempts(rows, inputs.len())))
}

/// Each input's attempt, from the statement's rows; an input without a row
/// raced.
fn attempts(rows: Vec<AttemptRow>, inputs: usize) -> Vec<AcquireAttempt> {
    let mut attempts: Vec<AcquireAttempt> = (0..inputs).map(|_| AcquireAttempt::Raced).collect();
    for row in rows {
        let Some(slot) = usize::try_from(row.ord)
            .ok()
            .and_then(|i| attempts.get_mut(i))
        else {
            continue;
        };
        *slot = if row.inserted {
            AcquireAttempt::Inserted(AcquiredRow::inserted(
                row.record.fencing_token,
                row.record.lease_expires_at.unwrap_or(row.record.db_now),
                row.record.expires_at,
            ))
        } else {
            AcquireAttempt::Existing(row.record)
        };
    }
    attempts
}

async fn finish(
    pool: &PgPool,
    bound: Duration,
    kept: KeptConnection,
    inputs: &[Arc<FinishInput>],
    wait: RowWait,
) -> (KeptConnection, StoreResult<Vec<Part<Option<Timestamp>>>>) {
    // The expiry check is written `(...) IS TRUE` so that no index can serve
    // it. On a table too young to have statistics, the planner guesses that
    // `expires_at > now()` keeps a third of the rows, and a plan reading the
    // whole table through the `expires_at` index then looks cheaper than a
    // key lookup per row. A connection keeps its generic plan until the next
    // ANALYZE, so every Complete scanned the table meanwhile.
    //
    // In a batch, a row another session holds (a row lock, or another
    // transaction's uncommitted write) makes the statement fail after
    // BATCH_ROW_WAIT (`$11` sets `lock_timeout` for this statement's own
    // transaction, in the input step, before any row is locked; NULL keeps
    // the session's setting, the statement timeout): its calls then run
    // alone, each waiting for its own row, so only the held one waits long.
    // (Locking the rows first with SKIP LOCKED instead isolated a held row
    // without the wait, but cost every batch a lock record per row and
    // three lookups of each: 12-15 % of new-key pairs/s at 16 and 64 callers.)
    const SQL: &str = "
        WITH v AS (
            SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int8[],
                                 $6::text[], $7::int4[], $8::bytea[], $9::jsonb[], $10::int8[])
                AS v(namespace, operation, subject, key, token, state, status, body, headers, ord)
            WHERE set_config('lock_timeout', coalesce($11, current_setting('lock_timeout')), true)
                  IS NOT NULL
        )
        UPDATE idempotency_records AS r
        SET state = v.state, lease_expires_at = NULL, completed_at = now(),
            response_status = v.status, response_body = v.body, response_headers = v.headers
        FROM v
        WHERE r.namespace = v.namespace AND r.operation = v.operation
          AND r.subject = v.subject AND r.key = v.key
          AND r.fencing_token = v.token AND r.state = 'in_progress'
          AND (r.expires_at > now()) IS TRUE
        RETURNING v.ord, r.completed_at, false AS passed";
    let order = key_order(inputs.iter().map(|input| &input.id));
    let column = |part: fn(&FinishInput) -> &str| -> Vec<&str> {
        order.iter().map(|&i| part(&inputs[i])).collect()
    };
    let tokens: Vec<i64> = order
        .iter()
        .map(|&i| token(inputs[i].fencing_token))
        .collect();
    let states: Vec<&str> = order.iter().map(|&i| inputs[i].state.as_str()).collect();
    let statuses: Vec<i32> = order.iter().map(|&i| status(&inputs[i].response)).collect();
    let bodies: Vec<&[u8]> = order
        .iter()
        .map(|&i| inputs[i].response.body.as_slice())
        .collect();
    let headers: Vec<Json<&std::collections::BTreeMap<String, String>>> = order
        .iter()
        .map(|&i| Json(&inputs[i].response.headers))
        .collect();
    let positions: Vec<i64> = order.iter().map(|&i| i as i64).collect();

    let _timer = QueryTimer::start("finish");
    let row_wait = match wait {
        RowWait::Brief => Some(format!("{}ms", BATCH_ROW_WAIT.as_millis())),
        RowWait::Full => None,
    };
    let query = sqlx::query_as::<_, (i64, Option<Timestamp>, bool)>(SQL)
        .bind(column(|input| input.id.namespace()))
        .bind(column(|input| input.id.operation()))
        .bind(column(|input| input.id.subject()))
        .bind(column(|input| input.id.key()))
        .bind(tokens)
        .bind(states)
        .bind(statuses)
        .bind(bodies)
        .bind(headers)
        .bind(positions)
        .bind(row_wait);
    let (kept, rows) = fetch_all_on_kept(pool, bound, kept, query).await;
    (kept, rows.map(|rows| finished(rows, inputs.len())))
}

/// Each input's part, from the statement's rows: finished at a time, passed
/// over, or (no row) not finished since no live attempt holds that token.
fn finished(
    rows: Vec<(i64, Option<Timestamp>, bool)>,
    inputs: usize,
) -> Vec<Part<Option<Timestamp>>> {
    let mut parts = vec![Part::Done(None); inputs];
    for (ord, completed_at, passed) in rows {
        if let Some(slot) = usize::try_from(ord).ok().and_then(|i| parts.get_mut(i)) {
            *slot = if passed {
                Part::Alone
            } else {
                Part::Done(completed_at)
            };
        }
    }
    parts
}
