//! `--serve-floor`: the least a gRPC service in front of Postgres can be, to
//! measure the service against. Acquire and Complete run pgbench's own two
//! statements (`bench/pgbench/new_key_pair.sql`: a plain `INSERT ... ON
//! CONFLICT DO NOTHING`, then a plain `UPDATE`), one per call, through sqlx,
//! behind tonic with its defaults: no layers, no validation, no batching, no
//! metrics, no logs, a connection per call in flight taken from a stack and
//! put back without the pool's check. It answers new-key pairs and nothing
//! else (every other RPC is UNIMPLEMENTED), and it is no service: nothing
//! it skips may be skipped by the real one. What the service costs beyond
//! it is ours; what it costs beyond pgbench is a gRPC hop's and the
//! driver's on this machine (`make bench-budget`).

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
use sqlx::{Connection, PgConnection, postgres::PgConnectOptions, types::Json};
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

type Timestamp = sqlx::types::chrono::DateTime<sqlx::types::chrono::Utc>;

/// Serves Acquire and Complete on `listener` for `serve_for`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    database: PgConnectOptions,
    serve_for: Duration,
) -> anyhow::Result<()> {
    // One connection at start, so that a wrong URL fails here, not per call.
    let first = PgConnection::connect_with(&database)
        .await
        .context("connecting to the database")?;
    let floor = Floor {
        database,
        idle: Arc::new(Mutex::new(vec![first])),
    };
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .add_service(IdempotencyServiceServer::new(floor))
        .serve_with_incoming_shutdown(incoming, tokio::time::sleep(serve_for))
        .await
        .context("serving the floor")
}

struct Floor {
    database: PgConnectOptions,
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

fn timestamp(at: Timestamp) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: at.timestamp(),
        nanos: at.timestamp_subsec_nanos() as i32,
    }
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
            return Err(Status::unimplemented("the floor answers new keys only"));
        };
        Ok(Response::new(pb::AcquireResponse {
            outcome: Some(pb::acquire_response::Outcome::Acquired(pb::Acquired {
                fencing_token: token as u64,
                lease_expires_at: Some(timestamp(lease_expires_at)),
                expires_at: Some(timestamp(expires_at)),
            })),
        }))
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
            return Err(Status::failed_precondition("no such attempt"));
        };
        Ok(Response::new(pb::CompleteResponse {
            completed_at: Some(timestamp(completed_at)),
        }))
    }

    async fn fail(
        &self,
        _: Request<pb::FailRequest>,
    ) -> Result<Response<pb::FailResponse>, Status> {
        Err(Status::unimplemented(
            "the floor answers new-key pairs only",
        ))
    }

    async fn renew(
        &self,
        _: Request<pb::RenewRequest>,
    ) -> Result<Response<pb::RenewResponse>, Status> {
        Err(Status::unimplemented(
            "the floor answers new-key pairs only",
        ))
    }

    async fn get(&self, _: Request<pb::GetRequest>) -> Result<Response<pb::GetResponse>, Status> {
        Err(Status::unimplemented(
            "the floor answers new-key pairs only",
        ))
    }

    async fn batch_acquire(
        &self,
        _: Request<pb::BatchAcquireRequest>,
    ) -> Result<Response<pb::BatchAcquireResponse>, Status> {
        Err(Status::unimplemented(
            "the floor answers new-key pairs only",
        ))
    }

    async fn batch_complete(
        &self,
        _: Request<pb::BatchCompleteRequest>,
    ) -> Result<Response<pb::BatchCompleteResponse>, Status> {
        Err(Status::unimplemented(
            "the floor answers new-key pairs only",
        ))
    }
}
