//! Builds the application (listeners bound, engine wired) and runs it until a
//! shutdown future resolves. Tests bind `127.0.0.1:0` and pass their own future.

use std::{future::Future, net::SocketAddr, time::Duration};

use metrics_exporter_prometheus::PrometheusHandle;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tonic::transport::{Server, server::TcpIncoming};
use tonic_health::ServingStatus;

use crate::{
    domain::Limits,
    engine::Engine,
    grpc::{
        GrpcService,
        admission::{AdmissionLayer, MemoryBudget, PER_CALL_BYTES},
        auth::{AuthLayer, Authorizer},
        connections::{self, ConnectionSettings},
        deadline::DeadlineLayer,
        pb,
        service::IdempotencyServiceServer,
    },
    health, maintenance,
    maintenance::ReaperSettings,
    metrics::NamespaceLabels,
    replay_cache::{ReplayCache, ReplayCacheSettings},
    security::{self, Mode, Security, SecurityConfig},
    settings::ServeArgs,
    store::{Store, batch::BatchSettings},
    telemetry,
};

/// What the running server needs beyond the database pool.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub grpc_addr: SocketAddr,
    /// Where to serve `/metrics`; `None` serves no metrics endpoint.
    pub metrics_addr: Option<SocketAddr>,
    /// Where to serve grpc.health.v1 alone, in plain text, for probes.
    pub health_addr: Option<SocketAddr>,
    /// Serve gRPC reflection.
    pub reflection: bool,
    /// TLS, caller identity and the namespace policy.
    pub security: SecurityConfig,
    /// Client connections and calls: how many, how soon they greet, HTTP/2 limits.
    pub connections: ConnectionSettings,
    pub limits: Limits,
    /// The longest a call of the service may take, whatever the caller's deadline.
    pub request_timeout: Duration,
    /// Memory the calls in flight may hold (messages, replies, a fixed cost
    /// each); calls past it are shed with UNAVAILABLE.
    pub max_in_flight_bytes: usize,
    pub health_check_interval: Duration,
    pub drain_timeout: Duration,
    /// The in-process reaper; `None` when a CronJob (or nobody) reaps.
    pub reaper: Option<ReaperSettings>,
    /// How often the table gauges are refreshed.
    pub stats_interval: Duration,
    /// Distinct namespaces named in metric labels.
    pub max_metric_namespaces: usize,
    /// Group commit; `None`: one statement per call.
    pub batching: Option<BatchSettings>,
    /// Finished records kept in memory for repeated Acquires; `None`: off.
    pub replay_cache: Option<ReplayCacheSettings>,
}

impl ServerConfig {
    pub fn from_args(args: &ServeArgs) -> Self {
        Self {
            grpc_addr: args.grpc_addr,
            metrics_addr: Some(args.metrics_addr),
            health_addr: args.health_addr,
            reflection: args.reflection,
            security: args.security.config(),
            connections: args.connections.settings(),
            limits: args.limits(),
            request_timeout: args.request_timeout,
            max_in_flight_bytes: args.max_in_flight_bytes,
            health_check_interval: args.health_check_interval,
            drain_timeout: args.drain_timeout,
            reaper: args.reaper_enabled.then(|| args.reaper.settings()),
            stats_interval: args.stats_interval,
            max_metric_namespaces: args.metrics_max_namespaces,
            batching: args.batching.then_some(BatchSettings {
                workers: args.batch_workers,
                max_size: args.batch_max_size,
                overlap_after: args.batch_overlap_after,
            }),
            replay_cache: (args.replay_cache_bytes > 0).then_some(ReplayCacheSettings {
                max_bytes: args.replay_cache_bytes,
                max_age: args.replay_cache_max_age,
            }),
        }
    }
}

/// Background tasks, aborted together when dropped.
struct BackgroundTasks(Vec<tokio::task::JoinHandle<()>>);

impl Drop for BackgroundTasks {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// How often the pool's connection counts are published.
const POOL_GAUGE_INTERVAL: Duration = Duration::from_secs(5);

/// Fewer connections than this beside the batch workers' draws a warning.
const FEW_SPARE_CONNECTIONS: usize = 4;

/// After draining, how long to wait for the pool's connections to come back.
const POOL_CLOSE_TIMEOUT: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error("invalid setting {0}")]
    Settings(#[from] crate::domain::InvalidField),
    #[error("security settings: {0}")]
    Security(#[from] security::SecurityError),
    #[error("binding {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("building the reflection service")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("gRPC server")]
    Transport(#[from] tonic::transport::Error),
}

/// Every batch worker, for Acquire and for Complete, may keep a connection
/// while calls keep coming; the other statements need at least one more.
fn check_pool_fits_batching(pool: &PgPool, batching: BatchSettings) -> Result<(), StartupError> {
    let kept = batching.kept_connections();
    let max_connections = pool.options().get_max_connections();
    let spare = usize::try_from(max_connections).map_or(usize::MAX, |max| max.saturating_sub(kept));
    if spare >= FEW_SPARE_CONNECTIONS {
        return Ok(());
    }
    if spare > 0 {
        // Takeovers, Get, Renew, Release and the gauges share what is left
        // (the health probe has a connection of its own); under load they
        // may wait for it.
        tracing::warn!(
            max_connections,
            kept_by_batch_workers = kept,
            "few database connections are left beside the batch workers"
        );
        return Ok(());
    }
    Err(crate::domain::InvalidField::new(
        "db_max_connections",
        format!(
            "must be more than {kept} with batching on (each batch worker, for Acquire and for \
             Complete, keeps a connection), got {max_connections}"
        ),
    )
    .into())
}

/// Every call the limits allow must fit in the memory budget, or it would
/// be shed forever.
fn check_budget_fits_a_call(config: &ServerConfig) -> Result<(), StartupError> {
    let largest = PER_CALL_BYTES + 2 * config.limits.max_message_bytes();
    if config.max_in_flight_bytes >= largest {
        return Ok(());
    }
    Err(crate::domain::InvalidField::new(
        "max_in_flight_bytes",
        format!(
            "must be at least {largest} bytes, what the largest message the limits allow costs \
             (twice the larger of 4 MiB and twice --max-response-bytes, plus {PER_CALL_BYTES}), \
             got {}",
            config.max_in_flight_bytes
        ),
    )
    .into())
}

pub struct Application {
    grpc_listener: TcpListener,
    metrics_listener: Option<TcpListener>,
    health_listener: Option<TcpListener>,
    security: Security,
    store: Store,
    config: ServerConfig,
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, StartupError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| StartupError::Bind { addr, source })
}

impl Application {
    /// Binds the listeners; nothing is served until [`Self::run_until_stopped`].
    pub async fn build(config: ServerConfig, pool: PgPool) -> Result<Self, StartupError> {
        // Install the recorder first: loading the security files records
        // gauges, and a metric recorded earlier goes nowhere.
        telemetry::metrics_handle();
        config.limits.check()?;
        check_budget_fits_a_call(&config)?;
        if let Some(batching) = config.batching {
            check_pool_fits_batching(&pool, batching)?;
        }
        let security = Security::load(&config.security)?;
        let grpc_listener = bind(config.grpc_addr).await?;
        let metrics_listener = match config.metrics_addr {
            Some(addr) => Some(bind(addr).await?),
            None => None,
        };
        let health_listener = match config.health_addr {
            Some(addr) => Some(bind(addr).await?),
            None => None,
        };
        Ok(Self {
            grpc_listener,
            metrics_listener,
            health_listener,
            security,
            store: match config.batching {
                Some(settings) => Store::with_batching(pool, settings),
                None => Store::new(pool),
            },
            config,
        })
    }

    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    pub fn health_addr(&self) -> Option<SocketAddr> {
        self.health_listener.as_ref().map(|listener| {
            listener
                .local_addr()
                .expect("a bound listener has an address")
        })
    }

    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_listener.as_ref().map(|listener| {
            listener
                .local_addr()
                .expect("a bound listener has an address")
        })
    }

    /// Serves until `shutdown` resolves, then drains: health goes NOT_SERVING,
    /// new connections and calls are refused, in-flight calls get up to
    /// `drain_timeout` to finish, and the pool closes.
    pub async fn run_until_stopped(
        self,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), StartupError> {
        let Self {
            grpc_listener,
            metrics_listener,
            health_listener,
            security,
            store,
            config,
        } = self;
        let pool = store.pool().clone();
        // Install the recorder before any task records: a metric recorded
        // earlier goes nowhere.
        let metrics = telemetry::metrics_handle();

        let (reporter, health_service) = tonic_health::server::health_reporter();
        health::set(&reporter, ServingStatus::NotServing).await;
        reporter
            .set_service_status(health::LIVENESS, ServingStatus::Serving)
            .await;
        let mut watcher = tokio::spawn(health::watch_database(
            store.pool().connect_options(),
            reporter.clone(),
            config.health_check_interval,
        ));
        let mut background = vec![
            tokio::spawn(maintenance::watch_table(
                pool.clone(),
                config.stats_interval,
            )),
            tokio::spawn(maintenance::watch_pool(pool.clone(), POOL_GAUGE_INTERVAL)),
        ];
        if let Some(reaper) = config.reaper.clone() {
            background.push(tokio::spawn(maintenance::run_reaper(pool.clone(), reaper)));
        }
        if let Some(listener) = metrics_listener {
            background.push(tokio::spawn(serve_metrics(listener, metrics)));
        }
        if let Some(listener) = health_listener {
            background.push(tokio::spawn(serve_health(listener, health_service.clone())));
        }
        background.push(tokio::spawn(
            security.clone().watch(config.security.reload_interval),
        ));
        let background = BackgroundTasks(background);

        // v1 for current tools, v1alpha for grpcurl 1.8 and older clients. The
        // google.rpc types let tools decode the error details we send.
        let reflection = || {
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
        };
        let reflection_v1 = config
            .reflection
            .then(|| reflection().build_v1())
            .transpose()?;
        let reflection_v1alpha = config
            .reflection
            .then(|| reflection().build_v1alpha())
            .transpose()?;

        let max_message = config.limits.max_message_bytes();
        let mut engine = Engine::new(store, config.limits.clone());
        if let Some(settings) = config.replay_cache {
            engine = engine.with_replay_cache(ReplayCache::new(settings));
        }
        let namespaces = NamespaceLabels::new(config.max_metric_namespaces);
        let authorizer = Authorizer::new(security.auth.clone());
        let admission = AdmissionLayer::new(
            config.limits.clone(),
            MemoryBudget::new(config.max_in_flight_bytes),
            namespaces.clone(),
        );
        let api = IdempotencyServiceServer::new(GrpcService::new(engine, namespaces, authorizer))
            .max_decoding_message_size(max_message);

        let addr = grpc_listener
            .local_addr()
            .map_err(|source| StartupError::Bind {
                addr: config.grpc_addr,
                source,
            })?;
        announce(addr, &security);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let stopped = async {
            let _ = stop_rx.await;
        };
        let router = config
            .connections
            .server()
            .max_connection_age(config.security.max_connection_age)
            // Outermost first: who calls (headers only), then the call's
            // deadline, which also bounds admission's wait for the message.
            .layer(AuthLayer::new(security.auth.clone()))
            .layer(DeadlineLayer::new(config.request_timeout))
            .layer(admission)
            .add_service(health_service)
            .add_optional_service(reflection_v1)
            .add_optional_service(reflection_v1alpha)
            .add_service(api);
        let gate = config.connections.gate();
        let server: std::pin::Pin<
            Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>,
        > = match &security.tls {
            Some(tls) => Box::pin(router.serve_with_incoming_shutdown(
                security::tls::incoming(grpc_listener, tls.clone(), gate),
                stopped,
            )),
            None => Box::pin(router.serve_with_incoming_shutdown(
                connections::plaintext(grpc_listener, gate),
                stopped,
            )),
        };
        tokio::pin!(server, shutdown);

        let result = tokio::select! {
            result = &mut server => result.map_err(StartupError::from),
            () = &mut shutdown => {
                // Wait for the watcher to stop: one running on another thread
                // could otherwise report SERVING after the NOT_SERVING below.
                watcher.abort();
                let _ = (&mut watcher).await;
                health::set(&reporter, ServingStatus::NotServing).await;
                let _ = stop_tx.send(());
                match tokio::time::timeout(config.drain_timeout, &mut server).await {
                    Ok(result) => result.map_err(StartupError::from),
                    Err(_) => {
                        tracing::warn!(timeout = ?config.drain_timeout, "in-flight calls did not finish in time");
                        Ok(())
                    }
                }
            }
        };
        watcher.abort();
        drop(background);
        // Each connection runs in its own task, so calls that outlived the
        // drain timeout may still hold database connections, and so may the
        // batch workers serving them (a kept connection is closed at its next
        // statement or after a second without one): bound the wait for them
        // too. Returning ends the process, and those calls with it.
        if tokio::time::timeout(POOL_CLOSE_TIMEOUT, pool.close())
            .await
            .is_err()
        {
            tracing::warn!("calls still held database connections at exit");
        }
        tracing::info!("stopped");
        result
    }
}

/// Says where the API is served and how exposed it is: loudly when anyone
/// who reaches the port may read and write every namespace.
fn announce(addr: SocketAddr, security: &Security) {
    let mode = security.mode.as_str();
    match security.mode {
        Mode::None => tracing::warn!(
            %addr,
            mode,
            "serving gRPC without TLS or authentication: whoever reaches this address may read \
             and write every namespace's records; see docs/security.md to turn auth on"
        ),
        Mode::Tls => tracing::warn!(
            %addr,
            mode,
            "serving gRPC over TLS without authentication: every caller may read and write every \
             namespace's records; see docs/security.md to turn auth on"
        ),
        Mode::Auth if security.tls.is_none() => tracing::warn!(
            %addr,
            mode,
            "serving gRPC without TLS: bearer tokens and stored responses cross the network in \
             plain text; only do this behind a proxy or mesh that encrypts"
        ),
        Mode::Auth => tracing::info!(
            %addr,
            mode,
            "serving gRPC over TLS; callers authenticated, namespaces enforced"
        ),
    }
}

/// Serves grpc.health.v1 alone, in plain text and without auth, until aborted.
async fn serve_health(
    listener: TcpListener,
    health: tonic_health::pb::health_server::HealthServer<
        impl tonic_health::pb::health_server::Health,
    >,
) {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving grpc.health.v1 for probes");
    }
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    if let Err(error) = Server::builder()
        .add_service(health)
        .serve_with_incoming(incoming)
        .await
    {
        tracing::error!(%error, "health endpoint stopped");
    }
}

/// Serves the Prometheus text format at `/metrics` until aborted.
async fn serve_metrics(listener: TcpListener, handle: PrometheusHandle) {
    use axum::{Router, routing::get};
    let upkeep = handle.clone();
    // Histograms and idle entries need periodic upkeep; rendering does some,
    // this does the rest. It runs beside the listener, within this task, so
    // that aborting the task stops both.
    let upkeep = async move {
        let mut ticker = tokio::time::interval(Duration::from_secs(5));
        loop {
            ticker.tick().await;
            upkeep.run_upkeep();
        }
    };
    let router = Router::new().route("/metrics", get(move || std::future::ready(handle.render())));
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving /metrics");
    }
    tokio::select! {
        result = axum::serve(listener, router) => {
            if let Err(error) = result {
                tracing::error!(%error, "metrics endpoint stopped");
            }
        }
        () = upkeep => {}
    }
}
