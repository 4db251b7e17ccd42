//! `--serve-floor`: the least a gRPC service in front of Postgres can be, to
//! measure the service against. Acquire and Complete run pgbench's own two
//! statements (`bench/pgbench/new_key_pair.sql`: a plain `INSERT ... ON
//! CONFLICT DO NOTHING`, then a plain `UPDATE`), one per call, through sqlx,
//! behind tonic with its defaults: no layers, no validation, no metrics, no
//! logs, a connection per call in flight taken from a stack and put back
//! without the pool's check. BatchAcquire and BatchComplete run the
//! durable ceiling's insert and update (`bench/pgbench/ceiling_pair.sql`) as
//! one plain multi-row statement per batch, no CTE, with the batch's columns
//! bound as arrays, as any batching service must bind them (the ceiling's
//! UPDATE picks its keys with `= ANY` in one scope; here every item has a
//! scope of its own, so it joins `unnest`): what a batch of calls can cost
//! at all, one statement and one commit per batch, with none of the
//! service's queue, contract or checks.
//! With `--floor-statements service` the batches run the service's own two
//! batch statements instead (its Acquire's insert-or-read and its Complete,
//! from `idempotency_server::store`), bound as the service binds them: what
//! the contract's statement shape costs beside the ceiling's, still with
//! none of the service around it.
//! It answers new-key pairs and nothing else (every other RPC, and an item
//! whose key exists, is UNIMPLEMENTED), and it is no service: nothing it
//! skips may be skipped by the real one. What the service costs beyond it
//! is ours; what it costs beyond pgbench is a gRPC hop's and the driver's
//! on this machine (`make bench-budget`).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::Context;
use idempotency_proto::pb::{
    self,
    idempotency_service_server::{IdempotencyService, IdempotencyServiceServer},
};
use idempotency_server::{
    grpc::status::to_rpc_status,
    store::{BATCH_FINISH_SQL, BATCH_INSERT_OR_READ_SQL, KeyOrder, batch_lock_timeout},
};
use sqlx::{
    Connection, PgConnection,
    postgres::{PgConnectOptions, types::PgInterval},
    types::Json,
};
use tonic::{Request, Response, Status};

/// pgbench's INSERT, with the key and fingerprint as parameters and the
/// lease and expiry read back, as an Acquire answers them.
pub(crate) const INSERT: &str = "
    INSERT INTO idempotency_records
        (namespace, operation, subject, key, state, fingerprint, fencing_token,
         created_at, expires_at, lease_expires_at)
    VALUES ($1, $2, $3, $4, 'in_progress', $5, 1,
            now(), now() + interval '24 hours', now() + interval '60 seconds')
    ON CONFLICT DO NOTHING
    RETURNING fencing_token, lease_expires_at, expires_at";

/// pgbench's UPDATE, with the response as parameters.
pub(crate) const UPDATE: &str = "
    UPDATE idempotency_records
    SET state = 'completed', lease_expires_at = NULL, completed_at = now(),
        response_status = $6, response_body = $7, response_headers = $8
    WHERE namespace = $1 AND operation = $2 AND subject = $3 AND key = $4
      AND fencing_token = $5
    RETURNING completed_at";

/// The ceiling's INSERT for a batch: the same row per key as [`INSERT`],
/// the batch's columns as arrays. Its rows say which keys were inserted (a
/// multi-row insert promises no order for them).
pub(crate) const BATCH_INSERT: &str = "
    INSERT INTO idempotency_records
        (namespace, operation, subject, key, state, fingerprint, fencing_token,
         created_at, expires_at, lease_expires_at)
    SELECT namespace, operation, subject, key, 'in_progress', fingerprint, 1,
           now(), now() + interval '24 hours', now() + interval '60 seconds'
    FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[])
        AS v(namespace, operation, subject, key, fingerprint)
    ON CONFLICT DO NOTHING
    RETURNING namespace, operation, subject, key, fencing_token, lease_expires_at, expires_at";

/// The ceiling's UPDATE for a batch: [`UPDATE`] for each key of the arrays.
pub(crate) const BATCH_UPDATE: &str = "
    UPDATE idempotency_records AS r
    SET state = 'completed', lease_expires_at = NULL, completed_at = now(),
        response_status = v.status, response_body = v.body, response_headers = v.headers
    FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int8[], $6::int4[],
                $7::bytea[], $8::jsonb[])
        AS v(namespace, operation, subject, key, token, status, body, headers)
    WHERE r.namespace = v.namespace AND r.operation = v.operation
      AND r.subject = v.subject AND r.key = v.key AND r.fencing_token = v.token
    RETURNING r.namespace, r.operation, r.subject, r.key, r.completed_at";

/// The sessions' planner settings: the serving pool's (`server/src/db.rs`;
/// its statement timeout aside), with which `make bench-budget` runs
/// pgbench too. The batch statements need
/// them: a generic plan of a join with `unnest` may otherwise scan the table.
const SESSION_SETTINGS: [(&str, &str); 4] = [
    ("enable_seqscan", "off"),
    ("enable_bitmapscan", "off"),
    ("jit", "off"),
    ("plan_cache_mode", "force_generic_plan"),
];

type Timestamp = sqlx::types::chrono::DateTime<sqlx::types::chrono::Utc>;

/// A record's scope and key.
type Scope<'a> = (&'a str, &'a str, &'a str, &'a str);

/// Which statements a batch runs (`--floor-statements`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Statements {
    /// The ceiling's: [`BATCH_INSERT`], [`BATCH_UPDATE`].
    #[default]
    Ceiling,
    /// The service's: its insert-or-read and its finish, as it binds them.
    Service,
}

/// Serves Acquire and Complete on `listener` for `serve_for`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    database: PgConnectOptions,
    statements: Statements,
    serve_for: Duration,
) -> anyhow::Result<()> {
    let database = database.options(SESSION_SETTINGS);
    // One connection at start, so that a wrong URL fails here, not per call.
    let first = PgConnection::connect_with(&database)
        .await
        .context("connecting to the database")?;
    let floor = Arc::new(Floor {
        database,
        statements,
        idle: Arc::new(Mutex::new(vec![first])),
    });
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .add_service(IdempotencyServiceServer::from_arc(floor.clone()))
        .add_service(crate::steps::Steps::new(floor))
        .serve_with_incoming_shutdown(incoming, tokio::time::sleep(serve_for))
        .await
        .context("serving the floor")
}

struct Floor {
    database: PgConnectOptions,
    statements: Statements,
    /// Connections not running a statement: the last one put back is the
    /// next one taken, as a lone caller's would be.
    idle: Arc<Mutex<Vec<PgConnection>>>,
}

impl Floor {
    async fn connection(&self) -> Result<PgConnection, Status> {
        let idle = self.idle.lock().expect("idle connections").pop();
        match idle {
            Some(connection) => Ok(connection),
            None => PgConnection::connect_with(&self.database)
                .await
                .map_err(unavailable),
        }
    }

    /// Puts a connection back after a statement that ended (one cut short
    /// is dropped with its future, as it should be).
    fn put_back(&self, connection: PgConnection) {
        self.idle.lock().expect("idle connections").push(connection);
    }
}

fn unavailable(error: sqlx::Error) -> Status {
    Status::unavailable(error.to_string())
}

fn id_of(id: Option<pb::RecordId>) -> Result<pb::RecordId, Status> {
    id.ok_or_else(|| Status::invalid_argument("id: required"))
}

/// A batch's ids, each required.
fn ids_of<'r, R: 'r>(
    requests: &'r [R],
    id: impl Fn(&'r R) -> Option<&'r pb::RecordId>,
) -> Result<Vec<&'r pb::RecordId>, Status> {
    requests
        .iter()
        .enumerate()
        .map(|(i, request)| {
            id(request)
                .ok_or_else(|| Status::invalid_argument(format!("requests[{i}].id: required")))
        })
        .collect()
}

/// One array parameter: `part` of each id.
fn column<'r>(
    ids: &[&'r pb::RecordId],
    part: impl Fn(&'r pb::RecordId) -> &'r str,
) -> Vec<&'r str> {
    ids.iter().map(|&id| part(id)).collect()
}

/// Each item's place, by its scope and key (a multi-row statement returns
/// its rows in no promised order). An item whose key is in the batch twice
/// keeps its first place; the later ones get no row.
fn places<'r>(ids: &[&'r pb::RecordId]) -> HashMap<Scope<'r>, usize> {
    let mut places = HashMap::with_capacity(ids.len());
    for (i, id) in ids.iter().enumerate() {
        let scope = (&*id.namespace, &*id.operation, &*id.subject, &*id.key);
        places.entry(scope).or_insert(i);
    }
    places
}

fn timestamp(at: Timestamp) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: at.timestamp(),
        nanos: at.timestamp_subsec_nanos() as i32,
    }
}

/// What an inserted item answers: its place, token, lease and expiry.
type Inserted = (usize, i64, Timestamp, Timestamp);

/// A batch of Completes' columns beside their ids.
struct Finish<'r> {
    tokens: Vec<i64>,
    statuses: Vec<i32>,
    bodies: Vec<&'r [u8]>,
    headers: Vec<Json<&'r HashMap<String, String>>>,
}

/// [`BATCH_INSERT`]: the inserted items, found by their keys.
async fn ceiling_insert(
    connection: &mut PgConnection,
    ids: &[&pb::RecordId],
    fingerprints: Vec<&[u8]>,
) -> sqlx::Result<Vec<Inserted>> {
    let rows: Vec<(String, String, String, String, i64, Timestamp, Timestamp)> =
        sqlx::query_as(BATCH_INSERT)
            .bind(column(ids, |id| &id.namespace))
            .bind(column(ids, |id| &id.operation))
            .bind(column(ids, |id| &id.subject))
            .bind(column(ids, |id| &id.key))
            .bind(fingerprints)
            .fetch_all(connection)
            .await?;
    let places = places(ids);
    Ok(rows
        .into_iter()
        .filter_map(
            |(namespace, operation, subject, key, token, lease, expires)| {
                let i = *places.get(&(&*namespace, &*operation, &*subject, &*key))?;
                Some((i, token, lease, expires))
            },
        )
        .collect())
}

/// The service's insert-or-read, bound as the service binds it: in key
/// order (its defence against deadlocks), a lifetime of 24 hours, a lease of
/// 60 seconds, its brief row wait. The items it inserted, by their places.
/// (A batch's keys must be distinct, as the service's batcher makes a
/// statement's: the load generator's are.)
async fn service_insert(
    connection: &mut PgConnection,
    ids: &[&pb::RecordId],
    fingerprints: Vec<&[u8]>,
) -> sqlx::Result<Vec<Inserted>> {
    let interval = |seconds: i64| PgInterval {
        months: 0,
        days: 0,
        microseconds: seconds * 1_000_000,
    };
    let order = key_order(ids);
    let rows: Vec<AttemptRow> = sqlx::query_as(BATCH_INSERT_OR_READ_SQL)
        .bind(order.column(ids, |id| id.namespace.as_str()))
        .bind(order.column(ids, |id| id.operation.as_str()))
        .bind(order.column(ids, |id| id.subject.as_str()))
        .bind(order.column(ids, |id| id.key.as_str()))
        .bind(order.column(&fingerprints, |fingerprint| *fingerprint))
        .bind(vec![interval(24 * 3600); ids.len()])
        .bind(vec![interval(60); ids.len()])
        .bind(batch_lock_timeout())
        .fetch_all(connection)
        .await?;
    Ok(rows
        .into_iter()
        .filter(|row| row.1)
        .filter_map(|(ord, _, _, _, token, _, expires, lease)| {
            Some((order.input(ord)?, token, lease?, expires))
        })
        .collect())
}

/// The service's order for a statement's keys, its own [`KeyOrder`].
fn key_order(ids: &[&pb::RecordId]) -> KeyOrder {
    KeyOrder::by_scope(ids.iter().map(|id| {
        (
            id.namespace.as_str(),
            id.operation.as_str(),
            id.subject.as_str(),
            id.key.as_str(),
        )
    }))
}

/// The leading columns of a row of the service's insert-or-read: its
/// input's place (from 1), whether it inserted, the state, fingerprint,
/// token, creation, expiry and lease (the rest of its columns unread).
type AttemptRow = (
    i64,
    bool,
    String,
    Vec<u8>,
    i64,
    Timestamp,
    Timestamp,
    Option<Timestamp>,
);

/// [`BATCH_UPDATE`]: the finished items, found by their keys.
async fn ceiling_update(
    connection: &mut PgConnection,
    ids: &[&pb::RecordId],
    finish: Finish<'_>,
) -> sqlx::Result<Vec<(usize, Timestamp)>> {
    let rows: Vec<(String, String, String, String, Timestamp)> = sqlx::query_as(BATCH_UPDATE)
        .bind(column(ids, |id| &id.namespace))
        .bind(column(ids, |id| &id.operation))
        .bind(column(ids, |id| &id.subject))
        .bind(column(ids, |id| &id.key))
        .bind(finish.tokens)
        .bind(finish.statuses)
        .bind(finish.bodies)
        .bind(finish.headers)
        .fetch_all(connection)
        .await?;
    let places = places(ids);
    Ok(rows
        .into_iter()
        .filter_map(|(namespace, operation, subject, key, completed_at)| {
            let i = *places.get(&(&*namespace, &*operation, &*subject, &*key))?;
            Some((i, completed_at))
        })
        .collect())
}

/// The service's finish, bound as the service binds it (in key order, its
/// brief row wait): the finished items, by their places.
async fn service_update(
    connection: &mut PgConnection,
    ids: &[&pb::RecordId],
    finish: Finish<'_>,
) -> sqlx::Result<Vec<(usize, Timestamp)>> {
    let order = key_order(ids);
    let rows: Vec<(i64, Option<Timestamp>)> = sqlx::query_as(BATCH_FINISH_SQL)
        .bind(order.column(ids, |id| id.namespace.as_str()))
        .bind(order.column(ids, |id| id.operation.as_str()))
        .bind(order.column(ids, |id| id.subject.as_str()))
        .bind(order.column(ids, |id| id.key.as_str()))
        .bind(order.column(&finish.tokens, |token| *token))
        .bind(vec!["completed"; ids.len()])
        .bind(order.column(&finish.statuses, |status| *status))
        .bind(order.column(&finish.bodies, |body| *body))
        .bind(order.column(&finish.headers, |headers| Json(headers.0)))
        .bind(batch_lock_timeout())
        .fetch_all(connection)
        .await?;
    Ok(rows
        .into_iter()
        .filter_map(|(ord, completed_at)| Some((order.input(ord)?, completed_at?)))
        .collect())
}

/// An Acquire's answer for a key the floor inserted.
fn acquired(token: i64, lease_expires_at: Timestamp, expires_at: Timestamp) -> pb::AcquireResponse {
    pb::AcquireResponse {
        outcome: Some(pb::acquire_response::Outcome::Acquired(pb::Acquired {
            fencing_token: token as u64,
            lease_expires_at: Some(timestamp(lease_expires_at)),
            expires_at: Some(timestamp(expires_at)),
        })),
    }
}

/// A Complete's answer.
fn completed(at: Timestamp) -> pb::CompleteResponse {
    pb::CompleteResponse {
        completed_at: Some(timestamp(at)),
    }
}

/// An Acquire of a key that exists: the floor answers new keys only.
fn not_new() -> Status {
    Status::unimplemented("the floor answers new keys only")
}

/// A Complete that found no attempt with its token.
fn no_attempt() -> Status {
    Status::failed_precondition("no such attempt")
}

/// Any RPC but the new-key pair's.
fn pairs_only() -> Status {
    Status::unimplemented("the floor answers new-key pairs only")
}

/// A batch's answers in its items' places: `answers` by place, `missing`
/// for an item without one.
fn in_places<T>(
    items: usize,
    answers: impl IntoIterator<Item = (usize, T)>,
    missing: impl Fn() -> Status,
) -> Vec<Result<T, Status>> {
    let mut placed: Vec<Option<T>> = (0..items).map(|_| None).collect();
    for (i, answer) in answers {
        placed[i] = Some(answer);
    }
    placed
        .into_iter()
        .map(|answer| answer.ok_or_else(&missing))
        .collect()
}

#[tonic::async_trait]
impl IdempotencyService for Floor {
    async fn acquire(
        &self,
        request: Request<pb::AcquireRequest>,
    ) -> Result<Response<pb::AcquireResponse>, Status> {
        let request = request.into_inner();
        let id = id_of(request.id)?;
        let mut connection = self.connection().await?;
        let row: Option<(i64, Timestamp, Timestamp)> = sqlx::query_as(INSERT)
            .bind(&id.namespace)
            .bind(&id.operation)
            .bind(&id.subject)
            .bind(&id.key)
            .bind(&request.fingerprint)
            .fetch_optional(&mut connection)
            .await
            .map_err(unavailable)?;
        self.put_back(connection);
        let Some((token, lease_expires_at, expires_at)) = row else {
            return Err(not_new());
        };
        Ok(Response::new(acquired(token, lease_expires_at, expires_at)))
    }

    async fn complete(
        &self,
        request: Request<pb::CompleteRequest>,
    ) -> Result<Response<pb::CompleteResponse>, Status> {
        let request = request.into_inner();
        let id = id_of(request.id)?;
        let response = request.response.unwrap_or_default();
        let headers: HashMap<String, String> = response.headers;
        let mut connection = self.connection().await?;
        let row: Option<(Timestamp,)> = sqlx::query_as(UPDATE)
            .bind(&id.namespace)
            .bind(&id.operation)
            .bind(&id.subject)
            .bind(&id.key)
            .bind(request.fencing_token as i64)
            .bind(response.status_code as i32)
            .bind(&response.body)
            .bind(Json(&headers))
            .fetch_optional(&mut connection)
            .await
            .map_err(unavailable)?;
        self.put_back(connection);
        let Some((completed_at,)) = row else {
            return Err(no_attempt());
        };
        Ok(Response::new(completed(completed_at)))
    }

    async fn fail(
        &self,
        _: Request<pb::FailRequest>,
    ) -> Result<Response<pb::FailResponse>, Status> {
        Err(pairs_only())
    }

    async fn renew(
        &self,
        _: Request<pb::RenewRequest>,
    ) -> Result<Response<pb::RenewResponse>, Status> {
        Err(pairs_only())
    }

    async fn get(&self, _: Request<pb::GetRequest>) -> Result<Response<pb::GetResponse>, Status> {
        Err(pairs_only())
    }

    async fn batch_acquire(
        &self,
        request: Request<pb::BatchAcquireRequest>,
    ) -> Result<Response<pb::BatchAcquireResponse>, Status> {
        let requests = request.into_inner().requests;
        let ids = ids_of(&requests, |request| request.id.as_ref())?;
        let fingerprints: Vec<&[u8]> = requests.iter().map(|r| r.fingerprint.as_slice()).collect();
        let mut connection = self.connection().await?;
        let inserted = match self.statements {
            Statements::Ceiling => ceiling_insert(&mut connection, &ids, fingerprints).await,
            Statements::Service => service_insert(&mut connection, &ids, fingerprints).await,
        }
        .map_err(unavailable)?;
        self.put_back(connection);
        use pb::batch_acquire_result::Result as Item;
        let answers = inserted
            .into_iter()
            .map(|(i, token, lease, expires)| (i, acquired(token, lease, expires)));
        let results = in_places(ids.len(), answers, not_new)
            .into_iter()
            .map(|result| pb::BatchAcquireResult {
                result: Some(
                    result
                        .map_or_else(|status| Item::Error(to_rpc_status(&status)), Item::Response),
                ),
            })
            .collect();
        Ok(Response::new(pb::BatchAcquireResponse { results }))
    }

    async fn batch_complete(
        &self,
        request: Request<pb::BatchCompleteRequest>,
    ) -> Result<Response<pb::BatchCompleteResponse>, Status> {
        let requests = request.into_inner().requests;
        let ids = ids_of(&requests, |request| request.id.as_ref())?;
        let tokens: Vec<i64> = requests.iter().map(|r| r.fencing_token as i64).collect();
        let empty = pb::StoredResponse::default();
        let responses: Vec<&pb::StoredResponse> = requests
            .iter()
            .map(|r| r.response.as_ref().unwrap_or(&empty))
            .collect();
        let statuses: Vec<i32> = responses.iter().map(|r| r.status_code as i32).collect();
        let bodies: Vec<&[u8]> = responses.iter().map(|r| r.body.as_slice()).collect();
        let headers: Vec<Json<&HashMap<String, String>>> =
            responses.iter().map(|r| Json(&r.headers)).collect();
        let finish = Finish {
            tokens,
            statuses,
            bodies,
            headers,
        };
        let mut connection = self.connection().await?;
        let finished = match self.statements {
            Statements::Ceiling => ceiling_update(&mut connection, &ids, finish).await,
            Statements::Service => service_update(&mut connection, &ids, finish).await,
        }
        .map_err(unavailable)?;
        self.put_back(connection);
        use pb::batch_complete_result::Result as Item;
        let answers = finished.into_iter().map(|(i, at)| (i, completed(at)));
        let results = in_places(ids.len(), answers, no_attempt)
            .into_iter()
            .map(|result| pb::BatchCompleteResult {
                result: Some(
                    result
                        .map_or_else(|status| Item::Error(to_rpc_status(&status)), Item::Response),
                ),
            })
            .collect();
        Ok(Response::new(pb::BatchCompleteResponse { results }))
    }
}
