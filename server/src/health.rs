//! `grpc.health.v1`: SERVING while the database answers, NOT_SERVING while it
//! does not, and NOT_SERVING for good once shutdown begins.

use std::{sync::Arc, time::Duration};

use sqlx::{ConnectOptions, Connection, PgConnection, postgres::PgConnectOptions};
use tonic_health::{ServingStatus, server::HealthReporter};

use crate::{
    grpc::{GrpcService, service::IdempotencyServiceServer},
    metrics::{DATABASE_UP, QueryTimer},
};

/// The health service name a liveness probe asks: SERVING for as long as the
/// process runs, whatever the database does, so an outage takes replicas out
/// of rotation (readiness, service "") without restarting them.
pub const LIVENESS: &str = "liveness";

/// Sets the overall ("") and the service's status together.
pub async fn set(reporter: &HealthReporter, status: ServingStatus) {
    reporter.set_service_status("", status).await;
    match status {
        ServingStatus::Serving => {
            reporter
                .set_serving::<IdempotencyServiceServer<GrpcService>>()
                .await
        }
        _ => {
            reporter
                .set_not_serving::<IdempotencyServiceServer<GrpcService>>()
                .await
        }
    }
}

/// Probes the database `options` name every `interval` and reports the
/// result. Runs until aborted.
///
/// The probe has a connection of its own, outside the pool: a pool that is
/// busy (every connection in use, calls waiting) means a loaded database,
/// not an unreachable one, and taking a loaded replica out of rotation only
/// moves its load onto the others.
pub async fn watch_database(
    options: Arc<PgConnectOptions>,
    reporter: HealthReporter,
    interval: Duration,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut probe: Option<PgConnection> = None;
    let mut last = None;
    loop {
        ticker.tick().await;
        // A probe slower than the interval counts as down.
        let limit = interval.max(Duration::from_secs(1));
        let failure = match tokio::time::timeout(limit, ping(&options, &mut probe)).await {
            Ok(Ok(())) => None,
            Ok(Err(error)) => Some(error.to_string()),
            Err(_) => Some(format!("no answer within {limit:?}")),
        };
        let up = failure.is_none();
        if !up {
            // Reconnect next time: the connection may have died with the outage.
            probe = None;
        }
        metrics::gauge!(DATABASE_UP).set(if up { 1.0 } else { 0.0 });
        if last != Some(up) {
            match &failure {
                None => tracing::info!("database reachable: SERVING"),
                Some(error) => tracing::warn!(%error, "database unreachable: NOT_SERVING"),
            }
            let status = if up {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            set(&reporter, status).await;
            last = Some(up);
        }
    }
}

/// One round trip on the probe's connection, connecting first when it has none.
async fn ping(options: &PgConnectOptions, probe: &mut Option<PgConnection>) -> sqlx::Result<()> {
    let _timer = QueryTimer::start("ping");
    let connection = match probe {
        Some(connection) => connection,
        None => probe.insert(options.connect().await?),
    };
    connection.ping().await
}
