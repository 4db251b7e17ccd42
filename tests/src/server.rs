use std::net::SocketAddr;

use idempotency_client::pb::idempotency_service_client::IdempotencyServiceClient;
use idempotency_server::{
    db::{self, PoolSettings},
    settings::Settings,
    startup::Application,
};
use sqlx::{PgPool, postgres::PgConnectOptions};
use tokio::{sync::oneshot, task::JoinHandle};
use tonic::transport::Channel;

use crate::TestDb;

/// The settings of a test server on `db`: those `idempotencyd serve` runs
/// with (the environment ignored), but for the ones below.
pub fn test_settings(db: &TestDb) -> Settings {
    settings_for(db.url().as_str())
}

/// [`test_settings`] for the database at `url`.
///
/// Everything not named here is as served by default: auth off (as for
/// `make run`; the auth tests turn it on), group commit and the replay cache
/// on (the contract holds with both), the connection limits (the connection
/// tests shorten what they test).
pub fn settings_for(url: &str) -> Settings {
    settings_with_flags(url, &[])
}

/// [`settings_for`], with `flags` besides: flags of `idempotencyd serve`
/// that the test settings do not already give (a flag given twice is an
/// error).
pub fn settings_with_flags(url: &str, flags: &[&str]) -> Settings {
    let test_flags = [
        "--database-url",
        url,
        // Free loopback ports, which the server reports once bound.
        "--grpc-addr",
        "127.0.0.1:0",
        "--metrics-addr",
        "127.0.0.1:0",
        // Health follows the database within a second.
        "--health-check-interval",
        "200ms",
        "--drain-timeout",
        "10s",
        // Tests that need the reaper or the table gauges turn them on.
        "--reaper-enabled",
        "false",
        "--stats-interval",
        "1h",
    ];
    Settings::from_flags(test_flags.iter().chain(flags)).expect("the test settings are valid flags")
}

/// A pool built the way `idempotencyd serve` builds it, for tests that
/// drive the store or the engine without a server.
pub fn server_pool(options: PgConnectOptions) -> PgPool {
    db::pool(options, &PoolSettings::default())
}

/// The real server, running in this process on its own port.
pub struct TestServer {
    pub addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    pub health_addr: Option<SocketAddr>,
    pub client: IdempotencyServiceClient<Channel>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl TestServer {
    /// Starts a server on `db` with the test settings.
    pub async fn start(db: &TestDb) -> Self {
        Self::start_with(test_settings(db)).await
    }

    /// Starts a server with `settings` (the database among them).
    pub async fn start_with(settings: Settings) -> Self {
        crate::test_log::init();
        let app = Application::build(settings).await.expect("building");
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

/// What most tests start from: a database of their own, the server on it,
/// and a client of the server.
pub struct TestApp {
    /// On the server's lazy channel; [`TestServer::new_client`] makes more.
    pub client: IdempotencyServiceClient<Channel>,
    pub server: TestServer,
    /// Declared last, so dropped last: the server lets go of it first.
    pub db: TestDb,
}

/// A fresh database and the server on it, with the test settings.
pub async fn spawn_app() -> TestApp {
    spawn_app_with(|_| {}).await
}

/// [`spawn_app`], with the test settings changed by `adjust` first.
pub async fn spawn_app_with(adjust: impl FnOnce(&mut Settings)) -> TestApp {
    let db = TestDb::new().await;
    let mut settings = test_settings(&db);
    adjust(&mut settings);
    let server = TestServer::start_with(settings).await;
    TestApp {
        client: server.client.clone(),
        server,
        db,
    }
}
