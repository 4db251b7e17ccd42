//! Builds the application from its [`Settings`], then runs it until a
//! shutdown future resolves.
//!
//! [`Application::build`] does everything that can fail: it installs the
//! metrics recorder, opens the pool (migrating first when asked), checks the
//! settings against each other, loads the security files, binds the
//! listeners (so it knows its ports: tests bind `127.0.0.1:0`), and wires
//! the store, engine, replay cache, health and the gRPC stack. Once it
//! returns, nothing accepts a connection, probes, reaps or reads or writes
//! the database until [`Application::run_until_stopped`], which only serves,
//! then drains. (`build` itself reaches the database only to migrate, when
//! asked: the pool connects lazily.) What is spawned before that touches
//! nothing: the store's batch workers (`Store::with_batching`), idle until
//! the server brings calls, which end when the store is dropped (with the
//! [`Application`] when it is dropped unserved, else once the server has
//! stopped and its last connection closed); and sqlx's pool upkeep, which
//! closes idle connections and, with no minimum set, opens none.
//!
//! Every command opens its database with the functions at the end of this
//! file ([`database_url`], [`pool`], [`migrate`]).

use std::{future::Future, net::SocketAddr, pin::Pin, time::Duration};

use futures_util::future::BoxFuture;
use metrics_exporter_prometheus::PrometheusHandle;
use sqlx::{PgPool, postgres::PgConnectOptions};
use tokio::{net::TcpListener, sync::oneshot, task::JoinHandle};
use tonic::transport::{Server, server::TcpIncoming};
use tonic_health::{
    ServingStatus,
    pb::health_server::{Health, HealthServer},
    server::HealthReporter,
};

use crate::{
    database_url::{DatabaseUrl, DatabaseUrlError},
    db,
    domain::{InvalidField, Limits},
    engine::Engine,
    grpc::{
        GrpcService,
        admission::{AdmissionLayer, MemoryBudget, PER_CALL_BYTES},
        auth::{AuthLayer, Authorizer},
        connections,
        deadline::DeadlineLayer,
        metrics::CallSeries,
        pb,
        service::IdempotencyServiceServer,
        stream::{Calls, StreamLayer},
        trace::TraceLayer,
    },
    health, maintenance,
    metrics::NamespaceLabels,
    replay_cache::ReplayCache,
    security::{self, Mode, Security},
    settings::{DatabaseArgs, Settings},
    store::{Store, batch::BatchSettings},
    telemetry::MetricsRecorder,
};

/// How often the pool's connection counts are published.
const POOL_GAUGE_INTERVAL: Duration = Duration::from_secs(5);

/// Fewer connections than this beside the batch workers' draws a warning.
const FEW_SPARE_CONNECTIONS: usize = 4;

/// After draining, how long to wait for the pool's connections to come back.
const POOL_CLOSE_TIMEOUT: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error(transparent)]
    DatabaseUrl(#[from] DatabaseUrlError),
    #[error("applying migrations")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    #[error("invalid setting {0}")]
    Settings(#[from] InvalidField),
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

/// The gRPC server, wired, its listener bound, not yet accepting: started
/// once, by [`Application::run_until_stopped`], with the signal that stops it.
type GrpcServer = Box<dyn FnOnce(oneshot::Receiver<()>) -> Serving + Send>;
type Serving = Pin<Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>>;

/// The server, built: every listener bound, every part wired, nothing
/// serving (only the store's idle batch workers are spawned; see the module
/// docs).
pub struct Application {
    grpc_addr: SocketAddr,
    metrics_addr: SocketAddr,
    health_addr: Option<SocketAddr>,
    security: Security,
    grpc: GrpcServer,
    /// Sets the health service's status: NOT_SERVING until the watcher's
    /// first answer from the database, and for good once draining begins.
    reporter: HealthReporter,
    /// Probes the database and reports what it finds; stopped before draining.
    watcher: BoxFuture<'static, ()>,
    /// What runs beside the gRPC server until it has drained: the gauges,
    /// the reaper, the /metrics and health endpoints, the security files' watch.
    background: Vec<BoxFuture<'static, ()>>,
    pool: PgPool,
    drain_timeout: Duration,
}

impl Application {
    /// Builds everything `serve` runs, from `settings`; binds the listeners
    /// but serves nothing until [`Self::run_until_stopped`].
    pub async fn build(settings: Settings) -> Result<Self, StartupError> {
        // First: the parts built below register their metric handles or set
        // their gauges once, when built (the replay cache's counters, the
        // memory budget's and the security files' gauges), and what is
        // registered or set before the recorder is installed records
        // nowhere. Each of them takes the recorder as proof that it comes
        // after, so this order is enforced by construction.
        let recorder = MetricsRecorder::install();
        crate::metrics::register_at_zero(&recorder);
        let pool = serving_pool(&settings.database, settings.migrate).await?;
        check(&settings, &pool)?;
        let security = Security::load(&settings.security.config(), &recorder)?;
        let (grpc_listener, grpc_addr) = bind(settings.grpc_addr).await?;
        let (metrics_listener, metrics_addr) = bind(settings.metrics_addr).await?;
        let health_listener = match settings.health_addr {
            Some(addr) => Some(bind(addr).await?),
            None => None,
        };
        let (reporter, health_service) =
            health_not_serving(settings.limits().max_small_message_bytes()).await;
        let watcher = Box::pin(health::watch_database(
            pool.connect_options(),
            reporter.clone(),
            settings.health_check_interval,
        ));
        let api = api(&settings, pool.clone(), &recorder, &security);
        let grpc = grpc_server(
            &settings,
            api,
            &security,
            &recorder,
            grpc_listener,
            health_service.clone(),
        )?;
        let health_addr = health_listener.as_ref().map(|(_, addr)| *addr);
        let endpoints = Endpoints {
            metrics: (metrics_listener, recorder.handle().clone()),
            health: health_listener.map(|(listener, _)| (listener, health_service)),
        };
        Ok(Self {
            grpc_addr,
            metrics_addr,
            health_addr,
            background: background_tasks(&settings, &pool, &security, endpoints),
            security,
            grpc,
            reporter,
            watcher,
            pool,
            drain_timeout: settings.drain_timeout,
        })
    }

    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
    }

    pub fn health_addr(&self) -> Option<SocketAddr> {
        self.health_addr
    }

    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics_addr
    }

    /// Serves until `shutdown` resolves, then drains: health goes NOT_SERVING,
    /// new connections and calls are refused, in-flight calls get up to
    /// `--drain-timeout` to finish, and the pool closes.
    pub async fn run_until_stopped(
        self,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), StartupError> {
        let mut watcher = tokio::spawn(self.watcher);
        let background = BackgroundTasks(self.background.into_iter().map(tokio::spawn).collect());
        announce(self.grpc_addr, &self.security);
        let (stop, stopped) = oneshot::channel();
        let mut server = (self.grpc)(stopped);

        let result = tokio::select! {
            result = &mut server => result.map_err(StartupError::from),
            () = shutdown => {
                // Wait for the watcher to stop: one running on another thread
                // could otherwise report SERVING after the NOT_SERVING below.
                watcher.abort();
                let _ = (&mut watcher).await;
                health::set(&self.reporter, ServingStatus::NotServing).await;
                let _ = stop.send(());
                drain(server, self.drain_timeout).await
            }
        };
        watcher.abort();
        drop(background);
        close(&self.pool).await;
        tracing::info!("stopped");
        result
    }
}

/// Lets the calls in flight finish, for at most `timeout`, once the server
/// has stopped accepting.
async fn drain(server: Serving, timeout: Duration) -> Result<(), StartupError> {
    match tokio::time::timeout(timeout, server).await {
        Ok(result) => result.map_err(StartupError::from),
        Err(_) => {
            tracing::warn!(?timeout, "in-flight calls did not finish in time");
            Ok(())
        }
    }
}

/// Closes the pool, once the server has drained.
async fn close(pool: &PgPool) {
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
}

/// Background tasks, aborted together when dropped.
struct BackgroundTasks(Vec<JoinHandle<()>>);

impl Drop for BackgroundTasks {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// The settings that can only be wrong together, checked before anything is
/// bound or loaded.
fn check(settings: &Settings, pool: &PgPool) -> Result<(), StartupError> {
    let limits = settings.limits();
    limits.check()?;
    check_budget_fits_a_call(&limits, settings.max_in_flight_bytes)?;
    check_otlp(settings)?;
    if let Some(batching) = settings.batch_settings() {
        check_pool_fits_batching(pool, batching)?;
    }
    Ok(())
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
    Err(InvalidField::new(
        "db_max_connections",
        format!(
            "must be more than {kept} with batching on (each batch worker, for Acquire and for \
             Complete, keeps a connection), got {max_connections}"
        ),
    )
    .into())
}

/// `--otlp-endpoint` needs the `otel` feature: a server built without it
/// refuses to start rather than silently export nothing.
fn check_otlp(settings: &Settings) -> Result<(), InvalidField> {
    if settings.otlp_endpoint.is_none() || cfg!(feature = "otel") {
        return Ok(());
    }
    Err(InvalidField::new(
        "otlp_endpoint",
        "this idempotencyd was built without the `otel` feature, so it cannot export spans; \
         unset --otlp-endpoint (IDEMPOTENCY_OTLP_ENDPOINT), or build with \
         `cargo build --features otel`",
    ))
}

/// Every call the limits allow must fit in the memory budget, or it would
/// be shed forever.
fn check_budget_fits_a_call(
    limits: &Limits,
    max_in_flight_bytes: usize,
) -> Result<(), StartupError> {
    let largest = PER_CALL_BYTES + 2 * limits.max_message_bytes();
    if max_in_flight_bytes >= largest {
        return Ok(());
    }
    Err(InvalidField::new(
        "max_in_flight_bytes",
        format!(
            "must be at least {largest} bytes, what the largest message the limits allow costs \
             (twice the larger of 4 MiB and twice --max-response-bytes, plus {PER_CALL_BYTES}), \
             got {}",
            max_in_flight_bytes
        ),
    )
    .into())
}

async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), StartupError> {
    let bound = match TcpListener::bind(addr).await {
        Ok(listener) => listener.local_addr().map(|local| (listener, local)),
        Err(error) => Err(error),
    };
    bound.map_err(|source| StartupError::Bind { addr, source })
}

/// The health service, NOT_SERVING (liveness aside) until the watcher's
/// first answer from the database. Its requests (a service name) are held to
/// `max_message_bytes`: admission does not know them, so tonic's 4 MiB
/// default would otherwise let each call buffer that much outside the
/// memory budget.
async fn health_not_serving(
    max_message_bytes: usize,
) -> (HealthReporter, HealthServer<impl Health>) {
    let (reporter, service) = tonic_health::server::health_reporter();
    let service = service.max_decoding_message_size(max_message_bytes);
    health::set(&reporter, ServingStatus::NotServing).await;
    reporter
        .set_service_status(health::LIVENESS, ServingStatus::Serving)
        .await;
    (reporter, service)
}

/// The idempotency API over `pool`: store, engine and replay cache, behind
/// the authorizer; and its per-call metric series, which admission shares.
fn api(
    settings: &Settings,
    pool: PgPool,
    recorder: &MetricsRecorder,
    security: &Security,
) -> (GrpcService, CallSeries) {
    let store = match settings.batch_settings() {
        Some(batching) => Store::with_batching(pool, batching),
        None => Store::new(pool),
    };
    let mut engine = Engine::new(store, settings.limits());
    if let Some(cache) = settings.replay_cache_settings() {
        engine = engine.with_replay_cache(ReplayCache::new(cache, recorder));
    }
    let series = CallSeries::new(
        NamespaceLabels::new(settings.metrics_max_namespaces),
        recorder,
    );
    let authorizer = Authorizer::new(security.auth.clone());
    (GrpcService::new(engine, series.clone(), authorizer), series)
}

/// The gRPC port: its connection limits, then for each call who calls, its
/// deadline and its admission, in front of health, reflection and the API.
fn grpc_server(
    settings: &Settings,
    (service, series): (GrpcService, CallSeries),
    security: &Security,
    recorder: &MetricsRecorder,
    listener: TcpListener,
    health: HealthServer<impl Health>,
) -> Result<GrpcServer, StartupError> {
    // Reflection's requests (a symbol or a file name) are held to the small
    // RPCs' limit, as health's are: admission does not know them.
    let small = settings.limits().max_small_message_bytes();
    let reflection_v1 = settings
        .reflection
        .then(|| reflection().build_v1())
        .transpose()?
        .map(|service| service.max_decoding_message_size(small));
    let reflection_v1alpha = settings
        .reflection
        .then(|| reflection().build_v1alpha())
        .transpose()?
        .map(|service| service.max_decoding_message_size(small));
    let budget = MemoryBudget::new(settings.max_in_flight_bytes, recorder);
    let admission = AdmissionLayer::new(settings.limits(), budget.clone(), series);
    let connections = settings.connections.settings();
    let call_limit = connections.call_limit();
    // A stream's messages are served by the same limit, auth, admission and
    // handlers as the unary calls below.
    let calls = Calls {
        limit: call_limit.clone(),
        admission: admission.clone(),
        auth: security.auth.clone(),
        service: service.clone(),
        request_timeout: settings.request_timeout,
        log_calls: settings.log_calls,
    };
    let (streams, drain) = StreamLayer::new(
        settings.stream_settings(),
        &settings.limits(),
        budget,
        calls,
    );
    let api = IdempotencyServiceServer::new(service)
        .max_decoding_message_size(settings.limits().max_message_bytes());
    let router = connections
        .server(streams, call_limit)
        .max_connection_age(settings.security.max_connection_age)
        // Outermost first: the call's span (so that whatever is logged
        // about the call carries its trace id, refusals included), who calls
        // (headers only), then the call's deadline, which also bounds
        // admission's wait for the message.
        .layer(TraceLayer::new(settings.log_calls))
        .layer(AuthLayer::new(security.auth.clone()))
        .layer(DeadlineLayer::new(settings.request_timeout))
        .layer(admission)
        .add_service(health)
        .add_optional_service(reflection_v1)
        .add_optional_service(reflection_v1alpha)
        .add_service(api);
    let gate = connections.gate();
    let tls = security.tls.clone();
    Ok(Box::new(move |stop| {
        let stopped = async move {
            let _ = stop.await;
            // Streams stop reading and answer what they read, within their
            // grace, while the server stops taking calls.
            drain.start();
        };
        match tls {
            Some(tls) => Box::pin(router.serve_with_incoming_shutdown(
                security::tls::incoming(listener, tls, gate),
                stopped,
            )),
            None => Box::pin(
                router
                    .serve_with_incoming_shutdown(connections::plaintext(listener, gate), stopped),
            ),
        }
    }))
}

/// Server reflection: v1 for current tools, v1alpha for grpcurl 1.8 and
/// older clients. The google.rpc types let tools decode the error details
/// we send.
fn reflection() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
}

/// The HTTP endpoints beside the gRPC port, bound: /metrics with the
/// recorder it renders, and the plain-text health port when asked for.
struct Endpoints<H> {
    metrics: (TcpListener, PrometheusHandle),
    health: Option<(TcpListener, HealthServer<H>)>,
}

/// What runs beside the gRPC server, not yet started.
fn background_tasks<H: Health>(
    settings: &Settings,
    pool: &PgPool,
    security: &Security,
    endpoints: Endpoints<H>,
) -> Vec<BoxFuture<'static, ()>> {
    let mut tasks: Vec<BoxFuture<'static, ()>> = vec![
        Box::pin(maintenance::watch_table(
            pool.clone(),
            settings.stats_interval,
        )),
        Box::pin(maintenance::watch_pool(pool.clone(), POOL_GAUGE_INTERVAL)),
    ];
    if let Some(reaper) = settings.reaper_settings() {
        tasks.push(Box::pin(maintenance::run_reaper(pool.clone(), reaper)));
    }
    let (listener, handle) = endpoints.metrics;
    tasks.push(Box::pin(serve_metrics(listener, handle)));
    if let Some((listener, health)) = endpoints.health {
        tasks.push(Box::pin(serve_health(listener, health)));
    }
    tasks.push(Box::pin(
        security.clone().watch(settings.security.reload_interval),
    ));
    tasks
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
async fn serve_health(listener: TcpListener, health: HealthServer<impl Health>) {
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

/// The serving pool (its statements planned as index lookups), after the
/// migrations when `--migrate` asks; logs which database, never its password.
async fn serving_pool(database: &DatabaseArgs, migrate: bool) -> Result<PgPool, StartupError> {
    let (url, options) = database_url(database)?;
    tracing::info!(database = %url.redacted(), "starting");
    let pool = self::pool(database, options.clone(), true);
    if migrate {
        self::migrate(database, options).await?;
        tracing::info!("migrations applied");
    }
    Ok(pool)
}

/// The database URL (read from its file once, at start) and its connect
/// options. No error quotes the URL or the file's content.
pub fn database_url(
    database: &DatabaseArgs,
) -> Result<(DatabaseUrl, PgConnectOptions), DatabaseUrlError> {
    let url = database.url()?;
    let options = url.connect_options()?;
    Ok((url, options))
}

/// A pool held to index lookups (serving, reaping), or not: migrations (a
/// backfill reads every row) and the admin CLI's `stats` read whole tables.
pub fn pool(
    database: &DatabaseArgs,
    options: PgConnectOptions,
    index_lookups_only: bool,
) -> PgPool {
    let settings = db::PoolSettings {
        index_lookups_only,
        ..database.pool_settings()
    };
    db::pool(options, &settings)
}

/// Applies the migrations, without the serving pool's statement timeout (5 s
/// by default), which would cut a long migration or the wait for another
/// pod's run short.
pub async fn migrate(
    database: &DatabaseArgs,
    options: PgConnectOptions,
) -> Result<(), StartupError> {
    let settings = db::PoolSettings {
        index_lookups_only: false,
        statement_timeout: database
            .statement_timeout
            .max(db::MIGRATION_STATEMENT_TIMEOUT),
        ..database.pool_settings()
    };
    let pool = db::pool(options, &settings);
    db::migrate(&pool).await.map_err(StartupError::Migrate)?;
    pool.close().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_otlp_endpoint_needs_the_otel_feature() {
        let mut settings =
            Settings::from_flags(["--database-url", "postgres://db/x"]).expect("valid flags");
        assert!(check_otlp(&settings).is_ok());
        settings.otlp_endpoint = Some("http://collector:4317".parse().unwrap());
        let checked = check_otlp(&settings);
        if cfg!(feature = "otel") {
            assert!(checked.is_ok());
        } else {
            let error = checked.unwrap_err().to_string();
            assert!(error.contains("otel"), "{error}");
        }
    }
}
