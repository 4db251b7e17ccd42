use std::{net::SocketAddr, time::Duration};

use idempotency_client::pb::idempotency_service_client::IdempotencyServiceClient;
use idempotency_server::{
    db::{self, PoolSettings},
    domain::Limits,
    startup::{Application, ServerConfig},
};
use sqlx::{PgPool, postgres::PgConnectOptions};
use tokio::{sync::oneshot, task::JoinHandle};
use tonic::transport::Channel;

use crate::TestDb;

/// Settings for a server on a free loopback port, with the contract's default limits.
pub fn test_config() -> ServerConfig {
    ServerConfig {
        grpc_addr: "127.0.0.1:0".parse().unwrap(),
        metrics_addr: None,
        health_addr: None,
        reflection: true,
        // Auth is opt-in, as for `make run`; the auth tests turn it on.
        security: idempotency_server::security::SecurityConfig::default(),
        // As served by default; the connection tests shorten what they test.
        connections: idempotency_server::grpc::connections::ConnectionSettings::default(),
        limits: Limits::default(),
        request_timeout: Duration::from_secs(10),
        max_in_flight_bytes: 64 * 1024 * 1024,
        health_check_interval: Duration::from_millis(200),
        drain_timeout: Duration::from_secs(10),
        // Tests that need the reaper or the table gauges turn them on.
        reaper: None,
        stats_interval: Duration::from_secs(3600),
        max_metric_namespaces: 200,
        // The contract holds with group commit on, as served by default.
        batching: Some(idempotency_server::store::batch::BatchSettings::default()),
        // And with the replay cache on, as served by default.
        replay_cache: Some(idempotency_server::replay_cache::ReplayCacheSettings::default()),
    }
}

/// A pool built the way `idempotencyd serve` builds it.
pub fn server_pool(options: PgConnectOptions) -> PgPool {
    db::pool(options, &PoolSettings::default())
}

/// The real server, running in this process on its own port.
pub struct TestServer {
    pub addr: SocketAddr,
    pub metrics_addr: Option<SocketAddr>,
    pub health_addr: Option<SocketAddr>,
    pub client: IdempotencyServiceClient<Channel>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl TestServer {
    /// Starts a server on `db` with the default test settings and the
    /// production pool settings.
    pub async fn start(db: &TestDb) -> Self {
        Self::start_with(test_config(), server_pool(db.connect_options())).await
    }

    /// Starts a server on `db` with `config` and the production pool settings.
    pub async fn start_config(db: &TestDb, config: ServerConfig) -> Self {
        Self::start_with(config, server_pool(db.connect_options())).await
    }

    pub async fn start_with(config: ServerConfig, pool: PgPool) -> Self {
        let app = Application::build(config, pool).await.expect("binding");
        let addr = app.grpc_addr();
        let metrics_addr = app.metrics_addr();
        let health_addr = app.health_addr();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            app.run_until_stopped(async {
                let _ = stopped.await;
            })
            .await
            .expect("server ran");
        });
        // Lazy: a TLS server does not speak to this plain-text channel, and
        // its tests make clients of their own.
        let client = IdempotencyServiceClient::new(
            Channel::from_shared(format!("http://{addr}"))
                .unwrap()
                .connect_lazy(),
        );
        Self {
            addr,
            metrics_addr,
            health_addr,
            client,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// A new connection to the server.
    pub async fn channel_to(addr: SocketAddr) -> Channel {
        Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .expect("connecting to the test server")
    }

    /// A client on its own connection (one HTTP/2 connection serialises little, but
    /// races are more honest across several).
    pub async fn new_client(&self) -> IdempotencyServiceClient<Channel> {
        IdempotencyServiceClient::new(Self::channel_to(self.addr).await)
    }

    /// Sends the shutdown signal without waiting.
    pub fn signal_shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    /// Signals shutdown and waits for the server to finish draining.
    pub async fn stop(mut self) {
        self.signal_shutdown();
        if let Some(task) = self.task.take() {
            task.await.expect("server task");
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}
