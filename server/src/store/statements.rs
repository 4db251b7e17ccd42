//! The hot path's SQL: Acquire's insert-or-read and takeover, and Complete /
//! terminal Fail. Each is one round trip on the connection it is given (a
//! kept one, which the batchers share, or one of the call's own), but for a
//! lone Acquire of an existing key that inserts first (see
//! [`insert_or_read_one`]). The SQL stays beside
//! the code that binds its `$n` and reads its rows, with the reasons for
//! each clause.
//!
//! Insert-or-read and finish take any number of calls at once, as arrays in
//! key order (see [`KeyOrder`]); each row they return carries its input's
//! place in those arrays (`ord`, from `WITH ORDINALITY`), which maps it back
//! to its caller. Their inputs must be for distinct records: with one record
//! twice, the insert's `JOIN inserted USING (...)` would answer `Inserted`
//! to both, and the update would apply only one of them, chosen by
//! Postgres. The batcher guarantees it (a statement holds each record once:
//! `batch::Batch::take`), a call alone has one input, and a debug build
//! checks it ([`KeyOrder::of`]).

use std::{sync::Arc, time::Duration};

use sqlx::{Postgres, postgres::PgArguments, query::QueryAs, types::Json};

use super::{
    AcquiredRow, Connection, RecordRow, StoreResult, interval,
    records::{AcquireAttempt, AcquireInput, FinishInput},
    replay_share::{LoneAcquire, ReplayShare},
    status, token,
};
use crate::domain::{RecordId, Timestamp};

/// How long a batch statement's rows may wait for a row another session
/// holds, before the statement fails (lock timeout, 55P03) and its calls
/// run again alone. Long enough for the usual wait, another statement's
/// commit of the same key; short enough that the other calls of the batch
/// are not held up noticeably.
pub const BATCH_ROW_WAIT: Duration = Duration::from_millis(100);

/// Whether a statement may wait for rows other sessions hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RowWait {
    /// A batch worker's statement: it never waits long for one call's row.
    Brief,
    /// A call alone, on a connection of its own: it waits up to the
    /// statement timeout, as any statement.
    Full,
}

impl RowWait {
    /// The statement's `lock_timeout`; `None` keeps the session's.
    fn lock_timeout(self) -> Option<String> {
        match self {
            Self::Brief => Some(batch_lock_timeout()),
            Self::Full => None,
        }
    }
}

/// A batch statement's `lock_timeout` parameter: [`BATCH_ROW_WAIT`].
pub fn batch_lock_timeout() -> String {
    format!("{}ms", BATCH_ROW_WAIT.as_millis())
}

/// Inputs in key order, which is the order the insert inserts (and so
/// locks) its rows in (`ORDER BY ord`): two concurrent inserts sharing keys
/// wait for each other instead of deadlocking. The update (`UPDATE ... FROM
/// v`) promises no order: two finishes sharing records could deadlock, and
/// Postgres then fails one (40P01), which counts as failing for its rows'
/// sake (`StoreError::concerns_rows`): its calls run again alone. (The
/// statements of one batcher never share a record: a call waits for the
/// end of the running statement that holds its record. Calls alone and
/// other replicas' statements may.)
///
/// Public for the load generator's floor, which binds these statements as
/// the store does.
pub struct KeyOrder(Vec<usize>);

impl KeyOrder {
    /// The key order of `records`, which must be distinct (see the module
    /// docs; checked in debug builds).
    fn of<'a>(records: impl Iterator<Item = &'a RecordId>) -> Self {
        Self::by_scope(records.map(sort_key))
    }

    /// The key order of records given as (namespace, operation, subject,
    /// key), which must be distinct (checked in debug builds).
    pub fn by_scope<'a>(
        scopes: impl Iterator<Item = (&'a str, &'a str, &'a str, &'a str)>,
    ) -> Self {
        let scopes: Vec<_> = scopes.collect();
        let mut order: Vec<usize> = (0..scopes.len()).collect();
        // Unstable is enough: the records are distinct.
        order.sort_unstable_by_key(|&i| scopes[i]);
        debug_assert!(
            order
                .windows(2)
                .all(|pair| scopes[pair[0]] != scopes[pair[1]]),
            "a statement's inputs are for distinct records"
        );
        Self(order)
    }

    /// One array parameter: `part` of each input, in key order.
    pub fn column<'i, T, V>(&self, inputs: &'i [T], part: impl Fn(&'i T) -> V) -> Vec<V> {
        self.0.iter().map(|&i| part(&inputs[i])).collect()
    }

    /// The input at `ord`, a row's place (from 1) in the arrays.
    pub fn input(&self, ord: i64) -> Option<usize> {
        let place = usize::try_from(ord).ok()?.checked_sub(1)?;
        self.0.get(place).copied()
    }
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

/// Creates each input's record, or reads it when it exists: one round trip
/// (but see [`insert_or_read_one`]), and no write at all for an existing
/// record. Answers in input order.
/// (Mostly one SQL statement and the reasons for it.)
pub(super) async fn insert_or_read(
    connection: &mut Connection,
    inputs: &[Arc<AcquireInput>],
    wait: RowWait,
    replays: &ReplayShare,
) -> StoreResult<Vec<AcquireAttempt>> {
    if let [input] = inputs {
        return Ok(vec![
            insert_or_read_one(connection, input, wait, replays).await?,
        ]);
    }
    // The insert skips existing keys without locking or writing them; the
    // second branch reads those with the statement's snapshot, which cannot
    // see this statement's own inserts (and so never reads a key twice). A key
    // committed by someone else after the snapshot is neither: `Raced`.
    //
    // The insert does not wait for a row another session merely locks (FOR
    // UPDATE, FOR KEY SHARE), but it does wait for another transaction that
    // inserted, updated or deleted a key it inserts (to know whether the key
    // will exist), until that one ends (tried on Postgres 15). In a batch
    // that wait is cut short: `$8` sets `lock_timeout` for this statement's
    // transaction, evaluated with the first input row, before any insert.
    // Locks on the table itself are taken before execution, so a table
    // lock (a migration, an operator's LOCK) still holds the whole
    // statement up to the statement timeout: that one is no single call's.
    // `$8` NULL keeps the session's setting.
    //
    // The rows are inserted in key order (`ORDER BY ord`: see `KeyOrder`).
    let order = KeyOrder::of(inputs.iter().map(|input| &input.id));
    let query = sqlx::query_as::<_, AttemptRow>(INSERT_OR_READ)
        .bind(order.column(inputs, |input| input.id.namespace()))
        .bind(order.column(inputs, |input| input.id.operation()))
        .bind(order.column(inputs, |input| input.id.subject()))
        .bind(order.column(inputs, |input| input.id.key()))
        .bind(order.column(inputs, |input| input.fingerprint.as_bytes()))
        .bind(order.column(inputs, |input| interval(input.ttl)))
        .bind(order.column(inputs, |input| interval(input.lease)))
        .bind(wait.lock_timeout());
    let rows = connection
        .run(|connection| query.fetch_all(connection))
        .await?;
    Ok(attempts(rows, &order, inputs.len()))
}

/// `insert_or_read`'s statement (its reasons are there). A copy of it runs in
/// pgbench for `make bench-budget` (`bench/pgbench/acquire_replay.sql`), and
/// the load generator's floor runs it (`--floor-statements service`).
pub const INSERT_OR_READ: &str = "
        WITH input AS (
            SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[],
                                 $6::interval[], $7::interval[])
                WITH ORDINALITY AS v(namespace, operation, subject, key, fingerprint, ttl, lease, ord)
            WHERE set_config('lock_timeout', coalesce($8, current_setting('lock_timeout')), true)
                  IS NOT NULL
        ), inserted AS (
            INSERT INTO idempotency_records
                (namespace, operation, subject, key, state, fingerprint, fencing_token,
                 created_at, expires_at, lease_expires_at)
            SELECT namespace, operation, subject, key, 'in_progress', fingerprint,
                   idempotency_lifetime_token(),
                   now(), now() + greatest(ttl, lease), now() + lease
            FROM input
            ORDER BY ord
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

/// A record's columns as [`RecordRow`] reads them, `db_now` aside: one list
/// for every statement here that reads a whole record.
macro_rules! record_columns {
    () => {
        "state, fingerprint, fencing_token, created_at, expires_at, lease_expires_at,
               completed_at, response_status, response_body, response_headers"
    };
}

/// A lone Acquire's insert of its new record, `$1`..`$7` as
/// [`bind_acquire`] binds them: one text for both of its statements
/// ([`insert_first_one`], [`read_first_one`]), which must create the same
/// record whichever runs.
macro_rules! insert_one {
    () => {
        "INSERT INTO idempotency_records
            (namespace, operation, subject, key, state, fingerprint, fencing_token,
             created_at, expires_at, lease_expires_at)
        SELECT $1, $2, $3, $4, 'in_progress', $5, idempotency_lifetime_token(),
               now(), now() + greatest($6::interval, $7::interval), now() + $7::interval"
    };
}

/// [`insert_or_read`] for one call (a call alone, a batch of one: every call
/// at low load), without the arrays: for a row of its own, `INSERT_OR_READ`'s
/// CTEs and read-back cost Postgres about 0.1 ms more per new-key pair
/// (pgbench, `docs/performance.md`). The statements cheapest for what lone
/// calls lately found ([`ReplayShare`]): a plain insert, then a read only
/// when the key exists; one statement that reads, then inserts only when
/// the key is absent; or a plain read, then an insert only when the key is
/// absent.
async fn insert_or_read_one(
    connection: &mut Connection,
    input: &AcquireInput,
    wait: RowWait,
    replays: &ReplayShare,
) -> StoreResult<AcquireAttempt> {
    let attempt = match replays.lone_acquire() {
        LoneAcquire::InsertFirst => insert_first_one(connection, input, wait).await?,
        LoneAcquire::ReadFirst => read_first_one(connection, input, wait).await?,
        LoneAcquire::ReadThenInsert => read_then_insert_one(connection, input, wait).await?,
    };
    match &attempt {
        AcquireAttempt::Inserted(_) => replays.observe(false),
        AcquireAttempt::Existing(_) => replays.observe(true),
        AcquireAttempt::Raced => {}
    }
    Ok(attempt)
}

/// A plain insert, as a hand-written service would write it. Only when it
/// inserts nothing, the key exists and a second round trip reads it.
async fn insert_first_one(
    connection: &mut Connection,
    input: &AcquireInput,
    wait: RowWait,
) -> StoreResult<AcquireAttempt> {
    // `$8` sets `lock_timeout` for the statement's transaction, before any
    // wait: the SELECT's filter runs before its row reaches the insert,
    // which may wait for another transaction that inserted or deleted the
    // key (see `insert_or_read`). NULL keeps the session's setting.
    const INSERT_ONE: &str = concat!(
        insert_one!(),
        "
        WHERE set_config('lock_timeout', coalesce($8, current_setting('lock_timeout')), true)
              IS NOT NULL
        ON CONFLICT (namespace, operation, subject, key) DO NOTHING
        RETURNING fencing_token, lease_expires_at, expires_at"
    );
    let insert = bind_acquire(
        sqlx::query_as::<_, (i64, Timestamp, Timestamp)>(INSERT_ONE),
        input,
    )
    .bind(wait.lock_timeout());
    let inserted = connection
        .run(|connection| insert.fetch_optional(connection))
        .await?;
    if let Some((fencing_token, lease_expires_at, expires_at)) = inserted {
        return Ok(AcquireAttempt::Inserted(AcquiredRow::inserted(
            fencing_token,
            lease_expires_at,
            expires_at,
        )));
    }
    // The key exists. Gone again by the time it is read (the reaper deleted
    // it, expired): the caller asks again, as after any race.
    Ok(match read(connection, &input.id).await? {
        Some(row) => AcquireAttempt::Existing(row),
        None => AcquireAttempt::Raced,
    })
}

/// A plain primary-key read, as a hand-written service replays; only when
/// the key is absent, the plain insert (which reads the key in turn when a
/// concurrent caller created it meanwhile). The least for a replay: about
/// 0.03 ms of Postgres's time less than [`read_first_one`]'s statement.
async fn read_then_insert_one(
    connection: &mut Connection,
    input: &AcquireInput,
    wait: RowWait,
) -> StoreResult<AcquireAttempt> {
    match read(connection, &input.id).await? {
        Some(row) => Ok(AcquireAttempt::Existing(row)),
        None => insert_first_one(connection, input, wait).await,
    }
}

/// One statement: the key's record as read, or the record inserted when the
/// read found none. No write at all for an existing key, whose read is the
/// only work (a replay, a duplicate); a new key pays the read's index probe
/// and the CTEs beside the insert.
async fn read_first_one(
    connection: &mut Connection,
    input: &AcquireInput,
    wait: RowWait,
) -> StoreResult<AcquireAttempt> {
    // Both CTEs see the statement's snapshot. A key another transaction
    // inserted after it is neither read nor inserted (the insert waits for
    // that transaction when it is still running, then skips the key): no
    // row, `Raced`, and the caller asks again. `$8` sets `lock_timeout`
    // before the insert can wait (see `insert_first_one`); the insert's
    // filter stops at `NOT EXISTS` for an existing key, which waits for
    // nothing.
    let query = bind_acquire(sqlx::query_as::<_, AttemptRow>(READ_FIRST_ONE), input)
        .bind(wait.lock_timeout());
    let row = connection
        .run(|connection| query.fetch_optional(connection))
        .await?;
    Ok(match row {
        Some(row) => attempt(row),
        None => AcquireAttempt::Raced,
    })
}

/// [`read_first_one`]'s statement (its reasons are there). A copy of it runs
/// in pgbench (`bench/pgbench/read_first_replay.sql`) beside `replay.sql`.
const READ_FIRST_ONE: &str = concat!(
    "
    WITH existing AS (
        SELECT ",
    record_columns!(),
    "
        FROM idempotency_records
        WHERE namespace = $1 AND operation = $2 AND subject = $3 AND key = $4
    ), inserted AS (
    ",
    insert_one!(),
    "
        WHERE NOT EXISTS (SELECT 1 FROM existing)
          AND set_config('lock_timeout', coalesce($8, current_setting('lock_timeout')), true)
              IS NOT NULL
        ON CONFLICT (namespace, operation, subject, key) DO NOTHING
        RETURNING ",
    record_columns!(),
    "
    )
    SELECT 1::int8 AS ord, true AS inserted, *, now() AS db_now FROM inserted
    UNION ALL
    SELECT 1, false, *, now() FROM existing"
);

/// An Acquire's `$1`..`$7`: its record's key, fingerprint, lifetime and lease.
fn bind_acquire<'q, O>(
    query: QueryAs<'q, Postgres, O, PgArguments>,
    input: &'q AcquireInput,
) -> QueryAs<'q, Postgres, O, PgArguments> {
    query
        .bind(input.id.namespace())
        .bind(input.id.operation())
        .bind(input.id.subject())
        .bind(input.id.key())
        .bind(input.fingerprint.as_bytes())
        .bind(interval(input.ttl))
        .bind(interval(input.lease))
}

/// Reads a record, expired or not, with the database's `now()`.
pub(super) async fn read(
    connection: &mut Connection,
    id: &RecordId,
) -> StoreResult<Option<RecordRow>> {
    const SQL: &str = concat!(
        "
        SELECT ",
        record_columns!(),
        ", now() AS db_now
        FROM idempotency_records
        WHERE namespace = $1 AND operation = $2 AND subject = $3 AND key = $4"
    );
    let query = sqlx::query_as::<_, RecordRow>(SQL)
        .bind(id.namespace())
        .bind(id.operation())
        .bind(id.subject())
        .bind(id.key());
    connection
        .run(|connection| query.fetch_optional(connection))
        .await
}

/// Each input's attempt, from the statement's rows; an input without a row
/// raced.
fn attempts(rows: Vec<AttemptRow>, order: &KeyOrder, inputs: usize) -> Vec<AcquireAttempt> {
    let mut attempts: Vec<AcquireAttempt> = (0..inputs).map(|_| AcquireAttempt::Raced).collect();
    for row in rows {
        let Some(slot) = order.input(row.ord).and_then(|i| attempts.get_mut(i)) else {
            continue;
        };
        *slot = attempt(row);
    }
    attempts
}

/// An input's attempt, from its row.
fn attempt(row: AttemptRow) -> AcquireAttempt {
    if row.inserted {
        AcquireAttempt::Inserted(AcquiredRow::inserted(
            row.record.fencing_token,
            row.record.lease_expires_at.unwrap_or(row.record.db_now),
            row.record.expires_at,
        ))
    } else {
        AcquireAttempt::Existing(row.record)
    }
}

/// Moves each input's live in-progress record, held with its token, to
/// `completed` or `failed` with its response. Answers in input order: when
/// it finished, or `None` when no live attempt holds that token. (Mostly one
/// SQL statement and the reasons for it.)
pub(super) async fn finish(
    connection: &mut Connection,
    inputs: &[Arc<FinishInput>],
    wait: RowWait,
) -> StoreResult<Vec<Option<Timestamp>>> {
    if let [input] = inputs {
        return Ok(vec![finish_one(connection, input, wait).await?]);
    }
    // The expiry check is written `(...) IS TRUE` so that no index can serve
    // it. On a table too young to have statistics, the planner guesses that
    // `expires_at > now()` keeps a third of the rows, and a plan reading the
    // whole table through the `expires_at` index then looks cheaper than a
    // key lookup per row. A connection keeps its generic plan until the next
    // ANALYZE, so every Complete scanned the table meanwhile. (See the
    // store's module docs on plans.)
    //
    // In a batch, a row another session holds (a row lock, or another
    // transaction's uncommitted write) makes the statement fail after
    // BATCH_ROW_WAIT (`$10` sets `lock_timeout` for this statement's own
    // transaction, in the input step, before any row is locked; NULL keeps
    // the session's setting, the statement timeout): its calls then run
    // alone, each waiting for its own row, so only the held one waits long.
    // (Locking the rows first with SKIP LOCKED instead isolated a held row
    // without the wait, but cost every batch a lock record per row and
    // three lookups of each: 12-15 % of new-key pairs/s at 16 and 64 callers.)
    let order = KeyOrder::of(inputs.iter().map(|input| &input.id));
    let query = sqlx::query_as::<_, (i64, Option<Timestamp>)>(FINISH)
        .bind(order.column(inputs, |input| input.id.namespace()))
        .bind(order.column(inputs, |input| input.id.operation()))
        .bind(order.column(inputs, |input| input.id.subject()))
        .bind(order.column(inputs, |input| input.id.key()))
        .bind(order.column(inputs, |input| token(input.fencing_token)))
        .bind(order.column(inputs, |input| input.state.as_str()))
        .bind(order.column(inputs, |input| status(&input.response)))
        .bind(order.column(inputs, |input| input.response.body.as_slice()))
        .bind(order.column(inputs, |input| Json(&input.response.headers)))
        .bind(wait.lock_timeout());
    let rows = connection
        .run(|connection| query.fetch_all(connection))
        .await?;
    let mut finished = vec![None; inputs.len()];
    for (ord, completed_at) in rows {
        if let Some(slot) = order.input(ord).and_then(|i| finished.get_mut(i)) {
            *slot = completed_at;
        }
    }
    Ok(finished)
}

/// `finish`'s statement (its reasons are there). A copy of it runs in
/// pgbench beside the durable ceiling (`bench/pgbench/service_batch_pair.sql`),
/// and the load generator's floor runs it (`--floor-statements service`).
pub const FINISH: &str = "
    WITH v AS (
        SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int8[],
                             $6::text[], $7::int4[], $8::bytea[], $9::jsonb[])
            WITH ORDINALITY
            AS v(namespace, operation, subject, key, token, state, status, body, headers, ord)
        WHERE set_config('lock_timeout', coalesce($10, current_setting('lock_timeout')), true)
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
    RETURNING v.ord, r.completed_at";

/// [`finish`] for one call, without the arrays (see
/// [`insert_or_read_one`]): the same conditions, on scalars.
async fn finish_one(
    connection: &mut Connection,
    input: &FinishInput,
    wait: RowWait,
) -> StoreResult<Option<Timestamp>> {
    // `$10` sets `lock_timeout` (see `finish`): the filter is evaluated on
    // the row as read, before the update locks it or waits for another
    // session's lock, and only on the row the other conditions select.
    const SQL: &str = "
        UPDATE idempotency_records
        SET state = $6, lease_expires_at = NULL, completed_at = now(),
            response_status = $7, response_body = $8, response_headers = $9
        WHERE namespace = $1 AND operation = $2 AND subject = $3 AND key = $4
          AND fencing_token = $5 AND state = 'in_progress'
          AND (expires_at > now()) IS TRUE
          AND set_config('lock_timeout', coalesce($10, current_setting('lock_timeout')), true)
              IS NOT NULL
        RETURNING completed_at";
    let query = sqlx::query_scalar::<_, Timestamp>(SQL)
        .bind(input.id.namespace())
        .bind(input.id.operation())
        .bind(input.id.subject())
        .bind(input.id.key())
        .bind(token(input.fencing_token))
        .bind(input.state.as_str())
        .bind(status(&input.response))
        .bind(input.response.body.as_slice())
        .bind(Json(&input.response.headers))
        .bind(wait.lock_timeout());
    connection
        .run(|connection| query.fetch_optional(connection))
        .await
}

/// Takes over a record that expired, was released, or whose lease passed
/// (when the fingerprints agree). `None`: it is no longer takeable. (Mostly
/// one SQL statement and the reasons for it.)
pub(super) async fn take_over(
    connection: &mut Connection,
    input: &AcquireInput,
) -> StoreResult<Option<AcquiredRow>> {
    // Two cases, one UPDATE each, in one statement and round trip. They see
    // the same snapshot, in which a record either expired or not, so at most
    // one of them updates it.
    //
    // `expired`: an expired record acts as absent, so it starts a new
    // lifetime, as if inserted, whatever its state and fingerprint. Its token
    // is larger than any of the old lifetime's (see the migration defining
    // the function): its old holder may still be running.
    //
    // `next_attempt`: a live record that was released, or whose lease
    // passed, gets its next attempt within the same lifetime: the token plus
    // one, when the fingerprints agree (a record acquired without one takes
    // this one's). Its expiry only moves forward, and a record never expires
    // under a live lease: expires_at >= lease_expires_at.
    //
    // READ COMMITTED re-checks the WHERE on the newest row version after
    // waiting for a concurrent writer, so of concurrent takeovers one wins.
    // (A row that was live in the snapshot stays live: no writer moves an
    // expiry back. One that expired and was meanwhile taken over by another
    // statement is live again and no longer this one's: `None`, and the
    // caller looks again.)
    const SQL: &str = "
        WITH expired AS (
            UPDATE idempotency_records SET
                state = 'in_progress',
                fingerprint = $5,
                fencing_token = idempotency_lifetime_token(),
                created_at = now(),
                expires_at = now() + greatest($6::interval, $7::interval),
                lease_expires_at = now() + $7::interval,
                completed_at = NULL,
                response_status = NULL, response_body = NULL, response_headers = NULL,
                previous_state = NULL
            WHERE namespace = $1 AND operation = $2 AND subject = $3 AND key = $4
              AND expires_at <= now()
            RETURNING fencing_token, lease_expires_at, expires_at, previous_state
        ), next_attempt AS (
            UPDATE idempotency_records SET
                state = 'in_progress',
                fingerprint = CASE WHEN fingerprint = '' THEN $5 ELSE fingerprint END,
                fencing_token = fencing_token + 1,
                expires_at = greatest(expires_at, now() + $7::interval),
                lease_expires_at = now() + $7::interval,
                completed_at = NULL,
                response_status = NULL, response_body = NULL, response_headers = NULL,
                previous_state = state
            WHERE namespace = $1 AND operation = $2 AND subject = $3 AND key = $4
              AND expires_at > now()
              AND (state = 'released' OR (state = 'in_progress' AND lease_expires_at <= now()))
              AND (fingerprint = $5 OR fingerprint = '' OR $5 = '')
            RETURNING fencing_token, lease_expires_at, expires_at, previous_state
        )
        SELECT * FROM expired UNION ALL SELECT * FROM next_attempt";
    let query = bind_acquire(sqlx::query_as::<_, AcquiredRow>(SQL), input);
    connection
        .run(|connection| query.fetch_optional(connection))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(key: &str) -> RecordId {
        RecordId::parse(
            "id",
            "ns".into(),
            "POST /x".into(),
            "user".into(),
            key.into(),
        )
        .unwrap()
    }

    #[test]
    fn a_row_maps_back_to_its_input_through_the_key_order() {
        let ids = [id("key-cccc"), id("key-aaaa"), id("key-bbbb")];
        let order = KeyOrder::of(ids.iter());

        // The arrays hold aaaa, bbbb, cccc: inputs 1, 2, 0.
        assert_eq!(order.0, [1, 2, 0]);
        assert_eq!(order.input(1), Some(1));
        assert_eq!(order.input(2), Some(2));
        assert_eq!(order.input(3), Some(0));
        assert_eq!(order.input(0), None);
        assert_eq!(order.input(4), None);
    }

    /// A statement's words, whitespace and the final `;` aside: how the
    /// pgbench copies below compare with the server's statements.
    fn words(sql: &str) -> String {
        let words: Vec<&str> = sql.split_whitespace().collect();
        words.join(" ").trim_end_matches(';').to_owned()
    }

    /// A statement's words from `marker` on, past an input that differs.
    fn after(sql: &str, marker: &str) -> String {
        let start = sql.find(marker).expect("the statement's input ends");
        words(&sql[start..])
    }

    /// `make bench-budget` runs the Acquire statement by hand in pgbench
    /// beside a plain SELECT; a copy that drifted would measure another
    /// statement. Only the input differs: pgbench builds the arrays.
    #[test]
    fn the_pgbench_copy_of_the_acquire_statement_matches_it_after_its_input() {
        let copy = include_str!("../../../bench/pgbench/acquire_replay.sql");
        let marker = "), inserted AS (";
        assert_eq!(after(copy, marker), after(INSERT_OR_READ, marker));
    }

    /// `bench/pgbench/read_first_replay.sql` runs a lone Acquire's read-first
    /// statement by hand beside `replay.sql`'s plain read; only its
    /// parameters are written as pgbench variables.
    #[test]
    fn the_pgbench_copy_of_the_read_first_statement_matches_it() {
        let copy = include_str!("../../../bench/pgbench/read_first_replay.sql");
        let statement: String = copy
            .lines()
            .filter(|line| !line.starts_with("--") && !line.starts_with('\\'))
            .collect::<Vec<_>>()
            .join("\n");
        let parameters = [
            ("'replay-' || :k", "$4"),
            (":ns", "$1"),
            (":op", "$2"),
            (":sub", "$3"),
            (":fp", "$5"),
            (":ttl", "$6"),
            (":lease", "$7"),
            (":wait", "$8"),
        ];
        let statement = parameters
            .iter()
            .fold(statement, |sql, (variable, parameter)| {
                sql.replace(variable, parameter)
            });
        assert_eq!(words(&statement), words(READ_FIRST_ONE));
    }

    /// `bench/pgbench/service_batch_pair.sql` runs both batch statements by
    /// hand beside the durable ceiling; only their inputs differ (pgbench
    /// builds the arrays), and the Complete's token condition (pgbench
    /// cannot carry the tokens: `<>` a token 0, on the same row).
    #[test]
    fn the_pgbench_copy_of_the_batch_statements_matches_them_after_their_inputs() {
        let copy = include_str!("../../../bench/pgbench/service_batch_pair.sql");
        let (acquire, complete) = copy
            .split_once("= (i.namespace, i.operation, i.subject, i.key));")
            .expect("the Acquire statement, then the Complete");
        let acquire = format!("{acquire}= (i.namespace, i.operation, i.subject, i.key))");
        let marker = "), inserted AS (";
        assert_eq!(after(&acquire, marker), after(INSERT_OR_READ, marker));
        let marker = "UPDATE idempotency_records AS r";
        assert_eq!(
            after(complete, marker)
                .replace("r.fencing_token <> v.token", "r.fencing_token = v.token"),
            after(FINISH, marker)
        );
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "distinct records")]
    fn inputs_for_one_record_twice_are_refused_in_debug_builds() {
        let ids = [id("key-aaaa"), id("key-bbbb"), id("key-aaaa")];
        KeyOrder::of(ids.iter());
    }
}
