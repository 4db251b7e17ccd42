//! Command line and environment. Every setting has a flag and an
//! `IDEMPOTENCY_*` variable (the database URL reads `DATABASE_URL`); defaults
//! show in `--help`; durations read like `30s`, `24h`, `7d`.
//!
//! Each setting is declared once, here: [`Settings`] (the flags of `serve`)
//! is what [`crate::startup::Application::build`] takes, and what the tests
//! build too ([`Settings::from_flags`], then fields changed). A new setting
//! is a field here, its use, and its line in the docs. The types the
//! settings convert to (`Limits`, `PoolSettings`, `BatchSettings`, …) keep
//! `Default` impls for tests that build them without flags; the tests below
//! keep each equal to the flags' defaults.

use std::{ffi::OsString, net::SocketAddr, path::PathBuf, time::Duration};

use clap::{ArgGroup, Args, Parser, Subcommand, ValueEnum};

pub use crate::database_url::{DatabaseUrl, DatabaseUrlError};
use crate::{
    db::PoolSettings,
    domain::Limits,
    grpc::stream::{SlotLimits, StreamSettings},
    maintenance::ReaperSettings,
    replay_cache::ReplayCacheSettings,
    store::{batch::BatchSettings, reaper::ReapLimits},
};

#[derive(Debug, Parser)]
#[command(
    name = "idempotencyd",
    version,
    about = "The idempotency service: gRPC over Postgres"
)]
pub struct Cli {
    /// What to do; `serve` when omitted.
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the gRPC API and /metrics (the default).
    Serve(Box<Settings>),
    /// Apply the database migrations, then exit.
    Migrate(MigrateArgs),
    /// Delete expired records (`--once` for a CronJob), then exit.
    Reap(ReapArgs),
    /// Operator commands on records, straight on the database.
    Admin(AdminArgs),
}

impl Cli {
    /// The command to run: `serve` with its defaults and environment when none is given.
    pub fn into_command(self) -> Command {
        self.command
            .unwrap_or_else(|| Command::Serve(Box::new(Settings::parse_from(["serve"]))))
    }
}

/// The settings of `serve`.
#[derive(Debug, Clone, Parser)]
pub struct Settings {
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub log: LogArgs,

    /// Address of the gRPC API. Loopback by default: serving other hosts is
    /// a decision (`0.0.0.0:50051`), best taken with TLS and auth on.
    #[arg(long, env = "IDEMPOTENCY_GRPC_ADDR", default_value = "127.0.0.1:50051")]
    pub grpc_addr: SocketAddr,
    /// Address of the Prometheus /metrics endpoint (plain HTTP, no auth).
    #[arg(
        long,
        env = "IDEMPOTENCY_METRICS_ADDR",
        default_value = "127.0.0.1:9090"
    )]
    pub metrics_addr: SocketAddr,
    /// Also serve grpc.health.v1 alone, in plain text and without auth, on
    /// this address: for probes that speak neither TLS nor a credential
    /// (Kubernetes' gRPC probes). Health stays on the gRPC port as well.
    #[arg(long, env = "IDEMPOTENCY_HEALTH_ADDR")]
    pub health_addr: Option<SocketAddr>,
    /// Serve gRPC server reflection (v1 and v1alpha). With auth on it answers
    /// only authenticated callers the policy names.
    #[arg(long, env = "IDEMPOTENCY_REFLECTION", default_value_t = true, action = clap::ArgAction::Set)]
    pub reflection: bool,
    #[command(flatten)]
    pub security: SecurityArgs,
    #[command(flatten)]
    pub connections: ConnectionArgs,
    #[command(flatten)]
    pub streams: StreamArgs,
    /// Apply migrations before serving.
    #[arg(long, env = "IDEMPOTENCY_MIGRATE")]
    pub migrate: bool,
    /// Threads serving calls. Default: one per CPU the process may use (its
    /// cgroup CPU limit counts). Set it to the CPUs the server really gets
    /// when it shares them, e.g. with Postgres on a small machine: idle
    /// threads waking each other cost CPU the database needs.
    #[arg(long, env = "IDEMPOTENCY_WORKER_THREADS")]
    pub worker_threads: Option<std::num::NonZeroUsize>,

    /// Record lifetime when Acquire gives none.
    #[arg(long, env = "IDEMPOTENCY_DEFAULT_TTL", default_value = "24h", value_parser = humantime::parse_duration)]
    pub default_ttl: Duration,
    /// Longest record lifetime a caller may ask for.
    #[arg(long, env = "IDEMPOTENCY_MAX_TTL", default_value = "7d", value_parser = humantime::parse_duration)]
    pub max_ttl: Duration,
    /// Lease when Acquire or Renew gives none.
    #[arg(long, env = "IDEMPOTENCY_DEFAULT_LEASE", default_value = "60s", value_parser = humantime::parse_duration)]
    pub default_lease: Duration,
    /// Longest lease a caller may ask for.
    #[arg(long, env = "IDEMPOTENCY_MAX_LEASE", default_value = "1h", value_parser = humantime::parse_duration)]
    pub max_lease: Duration,
    /// Largest stored response in bytes (body plus header names and values).
    #[arg(long, env = "IDEMPOTENCY_MAX_RESPONSE_BYTES", default_value_t = 1024 * 1024)]
    pub max_response_bytes: usize,
    /// Most items in one BatchAcquire or BatchComplete call.
    #[arg(long, env = "IDEMPOTENCY_MAX_BATCH_ITEMS", default_value_t = 100)]
    pub max_batch_items: usize,
    /// Most headers in one stored response. Counted before the request is
    /// decoded, so a map of a million headers costs nothing to refuse.
    #[arg(long, env = "IDEMPOTENCY_MAX_RESPONSE_HEADERS", default_value_t = 128)]
    pub max_response_headers: usize,

    /// Longest a call may take, whatever the caller's deadline (a shorter
    /// `grpc-timeout` from the caller applies instead): reading the
    /// message, queueing for a batch, waiting for a connection and the
    /// statements. Past it the call is answered UNAVAILABLE (reason
    /// REQUEST_TIMEOUT) and an unfinished statement's connection is closed.
    /// Keep it above --statement-timeout plus --db-acquire-timeout, so that
    /// a slow statement fails with its own error first.
    #[arg(long, env = "IDEMPOTENCY_REQUEST_TIMEOUT", default_value = "10s", value_parser = positive_duration)]
    pub request_timeout: Duration,
    /// Memory the calls in flight may hold: each call's message twice (the
    /// buffer and the decoded request), its reply, and 10 KiB. A call that
    /// would pass it is refused at once with UNAVAILABLE (reason
    /// OVERLOADED) before its message is read. At least twice the largest
    /// message (2 × 4 MiB + 10 KiB by default).
    #[arg(long, env = "IDEMPOTENCY_MAX_IN_FLIGHT_BYTES", default_value_t = 64 * 1024 * 1024)]
    pub max_in_flight_bytes: usize,

    /// How often the database is probed for the health service: NOT_SERVING
    /// within 2 × this of it no longer answering, SERVING within 1 × of it
    /// answering again (a probe has half of it to answer).
    #[arg(long, env = "IDEMPOTENCY_HEALTH_CHECK_INTERVAL", default_value = "5s", value_parser = positive_duration)]
    pub health_check_interval: Duration,
    /// On SIGTERM, how long in-flight calls may take to finish.
    #[arg(long, env = "IDEMPOTENCY_DRAIN_TIMEOUT", default_value = "20s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,

    /// Run the reaper in this process (one replica at a time deletes; turn
    /// off when a CronJob runs `idempotencyd reap --once` instead).
    #[arg(long, env = "IDEMPOTENCY_REAPER_ENABLED", default_value_t = true, action = clap::ArgAction::Set)]
    pub reaper_enabled: bool,
    #[command(flatten)]
    pub reaper: ReaperArgs,
    /// How often table size and row counts are refreshed for /metrics.
    #[arg(long, env = "IDEMPOTENCY_STATS_INTERVAL", default_value = "60s", value_parser = positive_duration)]
    pub stats_interval: Duration,
    /// Let concurrent Acquires, and concurrent Completes, share one statement
    /// and one commit (group commit). Off: one statement per call.
    #[arg(long, env = "IDEMPOTENCY_BATCHING", default_value_t = true, action = clap::ArgAction::Set)]
    pub batching: bool,
    /// Most statements in flight at once per kind of call when batching.
    /// One runs at a time; another starts only when the running one is slow
    /// (see --batch-overlap-after). Each worker keeps a connection while
    /// calls keep coming, so --db-max-connections must be more than twice this.
    #[arg(long, env = "IDEMPOTENCY_BATCH_WORKERS", default_value_t = 2)]
    pub batch_workers: usize,
    /// How long a statement runs before a second one may start beside it.
    /// Calls queue meanwhile and share the next statement, which is what
    /// makes batches large; a slow statement (a slow disk, a table lock)
    /// holds up the others no longer than this. (A row another session
    /// holds stalls a shared statement up to 100 ms; then every call in
    /// that statement runs alone, and only the held row's calls wait on.)
    #[arg(long, env = "IDEMPOTENCY_BATCH_OVERLAP_AFTER", default_value = "20ms", value_parser = humantime::parse_duration)]
    pub batch_overlap_after: Duration,
    /// Most calls in one statement when batching. The default holds a whole
    /// batch RPC of the default --max-batch-items; at 256 callers statements
    /// of up to 64 calls left the calls beyond them for the next statement
    /// (4 % fewer pairs/s, docs/performance.md).
    #[arg(long, env = "IDEMPOTENCY_BATCH_MAX_SIZE", default_value_t = 128)]
    pub batch_max_size: usize,
    /// Memory for finished records kept to answer repeated Acquires without
    /// a database round trip (bytes of ids and responses; 0 turns it off).
    #[arg(long, env = "IDEMPOTENCY_REPLAY_CACHE_BYTES", default_value_t = 64 * 1024 * 1024)]
    pub replay_cache_bytes: u64,
    /// Longest a cached record is used. An `admin purge` reaches replicas
    /// that cached the record only after this long.
    #[arg(long, env = "IDEMPOTENCY_REPLAY_CACHE_MAX_AGE", default_value = "10s", value_parser = humantime::parse_duration)]
    pub replay_cache_max_age: Duration,
    /// One log line per call of the API (target `idempotency_server::calls`):
    /// its RPC, gRPC code, outcome, duration and trace id. Off by default:
    /// at 10k calls/s that is 10k lines/s to format, ship and store. Every
    /// line logged while serving a call carries its trace id either way.
    #[arg(long, env = "IDEMPOTENCY_LOG_CALLS")]
    pub log_calls: bool,
    /// Export each call's span to this OpenTelemetry collector (OTLP over
    /// gRPC, e.g. http://otel-collector:4317), as a child of the caller's
    /// span when its `traceparent` names one. Needs a server built with
    /// the `otel` feature; unset: nothing is exported.
    #[arg(long, env = "IDEMPOTENCY_OTLP_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<url::Url>,
    /// Distinct `namespace` label values in /metrics; later namespaces are counted as `_other`.
    #[arg(
        long,
        env = "IDEMPOTENCY_METRICS_MAX_NAMESPACES",
        default_value_t = 200
    )]
    pub metrics_max_namespaces: usize,
}

/// TLS on the gRPC port, caller identity and the namespace policy
/// (docs/security.md). Every file is re-read when it changes.
#[derive(Debug, Clone, Args)]
pub struct SecurityArgs {
    /// PEM certificate chain of the gRPC port; with --tls-key turns TLS on.
    #[arg(long, env = "IDEMPOTENCY_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert (PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "IDEMPOTENCY_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificates that client certificates are verified against:
    /// turns on mTLS identity (the certificate's URI SAN, else its DNS SAN,
    /// is the principal). Needs --tls-cert.
    #[arg(long, env = "IDEMPOTENCY_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// JWKS file (JSON) that `authorization: Bearer <JWT>` tokens are
    /// verified against (RS256, ES256); `sub` is the principal. Needs
    /// --jwt-issuer and --jwt-audience.
    #[arg(long, env = "IDEMPOTENCY_JWT_JWKS", requires_all = ["jwt_issuer", "jwt_audience"])]
    pub jwt_jwks: Option<PathBuf>,
    /// The `iss` every JWT must carry, e.g. https://kubernetes.default.svc.cluster.local.
    #[arg(long, env = "IDEMPOTENCY_JWT_ISSUER", requires = "jwt_jwks")]
    pub jwt_issuer: Option<String>,
    /// The `aud` every JWT must include, e.g. idempotency.
    #[arg(long, env = "IDEMPOTENCY_JWT_AUDIENCE", requires = "jwt_jwks")]
    pub jwt_audience: Option<String>,
    /// TOML file of static bearer tokens, stored as SHA-256 hashes, for
    /// callers outside the cluster (docs/security.md shows the format).
    #[arg(long, env = "IDEMPOTENCY_STATIC_TOKENS")]
    pub static_tokens: Option<PathBuf>,
    /// TOML policy: which principals may use which namespaces, and how.
    /// Required once any credential (client CA, JWKS, static tokens) is on.
    #[arg(long, env = "IDEMPOTENCY_AUTH_POLICY")]
    pub auth_policy: Option<PathBuf>,
    /// Longest a client connection lives before the server asks the client
    /// to reconnect (HTTP/2 GOAWAY; calls in flight finish): an identity
    /// proven by a client certificate is checked again at the next
    /// handshake, so a rotated or expired certificate stops counting, and a
    /// renewed server certificate reaches every client.
    #[arg(long, env = "IDEMPOTENCY_MAX_CONNECTION_AGE", default_value = "1h", value_parser = positive_duration)]
    pub max_connection_age: Duration,
    /// How often the certificate, key, CA, JWKS, token and policy files are
    /// checked for changes.
    #[arg(long, env = "IDEMPOTENCY_RELOAD_INTERVAL", default_value = "10s", value_parser = positive_duration)]
    pub reload_interval: Duration,
}

impl SecurityArgs {
    pub fn config(&self) -> crate::security::SecurityConfig {
        use crate::security::{credentials::JwtSettings, tls::TlsFiles};
        crate::security::SecurityConfig {
            tls: self
                .tls_cert
                .clone()
                .zip(self.tls_key.clone())
                .map(|(cert, key)| TlsFiles {
                    cert,
                    key,
                    client_ca: self.tls_client_ca.clone(),
                }),
            jwt: self.jwt_jwks.clone().map(|jwks| JwtSettings {
                jwks,
                issuer: self.jwt_issuer.clone().unwrap_or_default(),
                audience: self.jwt_audience.clone().unwrap_or_default(),
            }),
            static_tokens: self.static_tokens.clone(),
            policy: self.auth_policy.clone(),
            reload_interval: self.reload_interval,
            max_connection_age: self.max_connection_age,
        }
    }
}

/// Client connections on the gRPC port (docs/operations.md, "Limits").
/// Sized from measurements (bench/connections.py): a connection costs the
/// server about 21 KiB (plain text) to 30 KiB (TLS), a call in flight 9 KiB.
#[derive(Debug, Clone, Args)]
pub struct ConnectionArgs {
    /// Most client connections open at once on the gRPC port; one more is
    /// accepted and closed at once, so its client fails fast and may try
    /// another replica. The health port and /metrics are not counted.
    #[arg(long, env = "IDEMPOTENCY_MAX_CONNECTIONS", default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,
    /// How long a new connection has to finish its TLS handshake and send
    /// the HTTP/2 preface before it is closed.
    #[arg(long, env = "IDEMPOTENCY_HANDSHAKE_TIMEOUT", default_value = "10s", value_parser = positive_duration)]
    pub handshake_timeout: Duration,
    /// Most calls in flight on one connection (HTTP/2
    /// MAX_CONCURRENT_STREAMS); a client opening more gets REFUSED_STREAM,
    /// which gRPC clients retry.
    #[arg(long, env = "IDEMPOTENCY_MAX_CONCURRENT_STREAMS", default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_concurrent_streams: u32,
    /// How long a connection may stay quiet before the server pings it.
    #[arg(long, env = "IDEMPOTENCY_HTTP2_KEEPALIVE_INTERVAL", default_value = "30s", value_parser = positive_duration)]
    pub http2_keepalive_interval: Duration,
    /// How long a ping may go unanswered before the connection is closed
    /// (a peer that vanished without a FIN or RST).
    #[arg(long, env = "IDEMPOTENCY_HTTP2_KEEPALIVE_TIMEOUT", default_value = "20s", value_parser = positive_duration)]
    pub http2_keepalive_timeout: Duration,
    /// Calls a client opened and cancelled before the server took them up,
    /// waiting at once, beyond which the connection is closed as an HTTP/2
    /// rapid-reset attack. Generous: a client whose calls time out while the
    /// server is paused (a SIGSTOP, a VM migration, a throttled CPU)
    /// sends all its cancellations at once when it resumes.
    #[arg(long, env = "IDEMPOTENCY_HTTP2_MAX_PENDING_RESET_STREAMS", default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    pub http2_max_pending_reset_streams: u32,
    /// Calls the server reset for a client's protocol errors, over one
    /// connection's life, beyond which it is closed (HTTP/2 "made you reset").
    #[arg(long, env = "IDEMPOTENCY_HTTP2_MAX_LOCAL_ERROR_RESET_STREAMS", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    pub http2_max_local_error_reset_streams: u32,
    /// Most calls in flight across every connection; one more is answered
    /// UNAVAILABLE (reason OVERLOADED) at once, before its request is read.
    /// Each costs about 9 KiB before any request byte, so the default holds
    /// them to some 36 MiB.
    #[arg(long, env = "IDEMPOTENCY_MAX_CONCURRENT_CALLS", default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_concurrent_calls: u32,
}

/// BatchStream calls (docs/contract.md, "A stream of batches"). Each of a
/// stream's messages is also a call to `--max-concurrent-calls` and the
/// memory budget while it is served.
#[derive(Debug, Clone, Args)]
pub struct StreamArgs {
    /// Most BatchStream calls open at once; one more is answered UNAVAILABLE
    /// (reason OVERLOADED) at once.
    #[arg(long, env = "IDEMPOTENCY_MAX_STREAMS", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_streams: u32,
    /// Most BatchStream calls open at once on one connection; one more is
    /// answered RESOURCE_EXHAUSTED (reason TOO_MANY_STREAMS).
    #[arg(long, env = "IDEMPOTENCY_STREAM_MAX_PER_CONNECTION", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    pub stream_max_per_connection: u32,
    /// With auth on, most BatchStream calls one principal may have open
    /// across all its connections (RESOURCE_EXHAUSTED, TOO_MANY_STREAMS).
    #[arg(long, env = "IDEMPOTENCY_STREAM_MAX_PER_PRINCIPAL", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub stream_max_per_principal: u32,
    /// Messages of one stream served at once, their unwritten answers
    /// included; past it the server stops reading the stream until an
    /// answer is written.
    #[arg(long, env = "IDEMPOTENCY_STREAM_MAX_IN_FLIGHT", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub stream_max_in_flight: u32,
    /// A stream with no message in flight for this long ends (status OK).
    #[arg(long, env = "IDEMPOTENCY_STREAM_IDLE_TIMEOUT", default_value = "5m", value_parser = positive_duration)]
    pub stream_idle_timeout: Duration,
    /// A stream ends (status OK, after answering what it read) at this age,
    /// give or take a tenth at random, so that long-lived streams spread
    /// over new replicas; and by --max-connection-age, counted from the
    /// connection's TLS handshake (over plain text, from the stream's
    /// opening), so that a client certificate is proven again in time.
    #[arg(long, env = "IDEMPOTENCY_STREAM_MAX_AGE", default_value = "30m", value_parser = positive_duration)]
    pub stream_max_age: Duration,
}

impl ConnectionArgs {
    pub fn settings(&self) -> crate::grpc::connections::ConnectionSettings {
        crate::grpc::connections::ConnectionSettings {
            max_connections: self.max_connections as usize,
            handshake_timeout: self.handshake_timeout,
            max_concurrent_streams: self.max_concurrent_streams,
            keepalive_interval: self.http2_keepalive_interval,
            keepalive_timeout: self.http2_keepalive_timeout,
            max_pending_accept_reset_streams: self.http2_max_pending_reset_streams as usize,
            max_local_error_reset_streams: self.http2_max_local_error_reset_streams as usize,
            max_concurrent_calls: self.max_concurrent_calls as usize,
        }
    }
}

/// How expired records are deleted.
#[derive(Debug, Clone, Args)]
pub struct ReaperArgs {
    /// Time between reaper runs.
    #[arg(long, env = "IDEMPOTENCY_REAPER_INTERVAL", default_value = "60s", value_parser = positive_duration)]
    pub reaper_interval: Duration,
    /// Rows deleted per statement.
    #[arg(long, env = "IDEMPOTENCY_REAPER_BATCH_SIZE", default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    pub reaper_batch_size: u32,
    /// Pause between two delete statements.
    #[arg(long, env = "IDEMPOTENCY_REAPER_BATCH_PAUSE", default_value = "50ms", value_parser = humantime::parse_duration)]
    pub reaper_batch_pause: Duration,
    /// Most rows deleted by one run; a run that reaches it is followed at once
    /// (with `reap --once`, the next run is the next Job).
    #[arg(
        long,
        env = "IDEMPOTENCY_REAPER_MAX_PER_RUN",
        default_value_t = 1_000_000,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub reaper_max_per_run: u64,
}

impl ReaperArgs {
    pub fn settings(&self) -> ReaperSettings {
        ReaperSettings {
            interval: self.reaper_interval,
            limits: ReapLimits {
                batch_size: self.reaper_batch_size,
                batch_pause: self.reaper_batch_pause,
                max_per_run: self.reaper_max_per_run,
            },
        }
    }
}

/// The settings of `reap`.
#[derive(Debug, Clone, Args)]
pub struct ReapArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub log: LogArgs,
    #[command(flatten)]
    pub reaper: ReaperArgs,
    /// Run once and exit (status 0 when done or when another process holds
    /// the reaper lock, 1 on error); without it, run every --reaper-interval.
    #[arg(long)]
    pub once: bool,
}

/// The settings of `admin`.
#[derive(Debug, Clone, Args)]
pub struct AdminArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// Logs, audit lines among them, go to stderr: stdout is the answer.
    #[command(flatten)]
    pub log: LogArgs,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: AdminCommand,
}

#[derive(Debug, Clone, Subcommand)]
pub enum AdminCommand {
    /// Show one record: state, times, token, response size.
    Get(RecordIdArgs),
    /// Delete one record so its key can be used again, or every record of a
    /// namespace matching the parts given. Asks before deleting more than
    /// one (or --yes); writes an audit line (log target `audit`). A replica
    /// that replayed a record recently answers from its replay cache until
    /// --replay-cache-max-age (10 s) passes.
    Purge(PurgeArgs),
    /// List in-progress records whose lease expired more than --older-than ago.
    Stuck {
        /// How long past its lease a record must be.
        #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
        older_than: Duration,
        /// Most records listed.
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Records by namespace and state (exact: scans the table), and the table's size.
    Stats,
}

/// The four parts of a record id.
#[derive(Debug, Clone, Args)]
pub struct RecordIdArgs {
    #[arg(long)]
    pub namespace: String,
    #[arg(long)]
    pub operation: String,
    #[arg(long, default_value = "")]
    pub subject: String,
    #[arg(long)]
    pub key: String,
}

/// What `admin purge` deletes: one record when --operation and --key are
/// given (its subject --subject, empty when left out), otherwise every record
/// of the namespace matching the parts given.
#[derive(Debug, Clone, Args)]
pub struct PurgeArgs {
    /// The namespace whose records are purged.
    #[arg(long)]
    pub namespace: String,
    /// Only this operation; every operation when left out.
    #[arg(long)]
    pub operation: Option<String>,
    /// Only this subject. Left out: the empty subject when --operation and
    /// --key name one record, every subject otherwise.
    #[arg(long)]
    pub subject: Option<String>,
    /// Only this key; every key when left out.
    #[arg(long)]
    pub key: Option<String>,
    /// Delete more than one record without asking (needed when stdin is not a terminal).
    #[arg(long)]
    pub yes: bool,
    /// Who runs the purge, for the audit line. Default: $USER or $LOGNAME,
    /// else the process's uid.
    #[arg(long, env = "IDEMPOTENCY_ADMIN_OPERATOR")]
    pub operator: Option<String>,
}

impl Settings {
    /// Settings from `flags` (those of `serve`, without the command's name)
    /// and the defaults, the environment ignored: how the tests build their
    /// server's settings, whatever variables the shell that runs them holds.
    pub fn from_flags<I, T>(flags: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString>,
    {
        use clap::{CommandFactory, FromArgMatches};
        let command = Self::command().mut_args(|arg| arg.env(None::<&'static str>));
        let args =
            std::iter::once(OsString::from("serve")).chain(flags.into_iter().map(Into::into));
        Self::from_arg_matches(&command.try_get_matches_from(args)?)
    }

    pub fn limits(&self) -> Limits {
        Limits {
            default_ttl: self.default_ttl,
            max_ttl: self.max_ttl,
            default_lease: self.default_lease,
            max_lease: self.max_lease,
            max_response_bytes: self.max_response_bytes,
            max_batch_items: self.max_batch_items,
            max_response_headers: self.max_response_headers,
        }
    }

    /// Group commit; `None`: one statement per call.
    pub fn batch_settings(&self) -> Option<BatchSettings> {
        self.batching.then_some(BatchSettings {
            workers: self.batch_workers,
            max_size: self.batch_max_size,
            overlap_after: self.batch_overlap_after,
        })
    }

    /// BatchStream's limits. Answers may wait unread as long as a call may
    /// take (--request-timeout); draining streams get half of
    /// --drain-timeout to answer what they read, so that they end with a
    /// status of their own before the server gives up on its calls.
    pub fn stream_settings(&self) -> StreamSettings {
        let streams = &self.streams;
        StreamSettings {
            slots: SlotLimits {
                max_streams: streams.max_streams as usize,
                per_connection: streams.stream_max_per_connection as usize,
                per_principal: streams.stream_max_per_principal as usize,
            },
            max_in_flight: streams.stream_max_in_flight as usize,
            idle_timeout: streams.stream_idle_timeout,
            max_age: streams.stream_max_age,
            max_connection_age: self.security.max_connection_age,
            write_timeout: self.request_timeout,
            drain_grace: self.drain_timeout / 2,
        }
    }

    /// Finished records kept in memory for repeated Acquires; `None`: off.
    pub fn replay_cache_settings(&self) -> Option<ReplayCacheSettings> {
        (self.replay_cache_bytes > 0).then_some(ReplayCacheSettings {
            max_bytes: self.replay_cache_bytes,
            max_age: self.replay_cache_max_age,
        })
    }

    /// The in-process reaper; `None` when a CronJob (or nobody) reaps.
    pub fn reaper_settings(&self) -> Option<ReaperSettings> {
        self.reaper_enabled.then(|| self.reaper.settings())
    }
}

/// The settings of `migrate`.
#[derive(Debug, Clone, Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

/// A period of a background loop: zero is refused, as it would stop the
/// loop (a ticker of zero panics in its task) while the process serves on.
fn positive_duration(text: &str) -> Result<Duration, String> {
    match humantime::parse_duration(text) {
        Ok(duration) if duration.is_zero() => Err("must be longer than 0".to_owned()),
        Ok(duration) => Ok(duration),
        Err(error) => Err(error.to_string()),
    }
}

/// Where the database is, and how the pool uses it. The URL comes from
/// exactly one of --database-url (DATABASE_URL) and --database-url-file
/// (DATABASE_URL_FILE).
#[derive(Debug, Clone, Args)]
#[command(group(
    ArgGroup::new("database_url_source")
        .args(["database_url", "database_url_file"])
        .required(true)
        .multiple(false)
))]
pub struct DatabaseArgs {
    /// Postgres URL, e.g. postgres://user:password@host:5432/idempotency.
    /// Percent-encode `/`, `?`, `#` and `@` in the user name and password
    /// (`/` as %2F). Or give --database-url-file instead.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, value_name = "URL")]
    pub database_url: Option<DatabaseUrl>,
    /// A file holding the Postgres URL (a mounted secret), read at start,
    /// trailing whitespace ignored: the password stays out of the process's
    /// arguments and environment. Instead of --database-url, and with
    /// DATABASE_URL unset.
    #[arg(long, env = "DATABASE_URL_FILE", value_name = "PATH")]
    pub database_url_file: Option<PathBuf>,
    /// Most connections the pool opens.
    #[arg(long, env = "IDEMPOTENCY_DB_MAX_CONNECTIONS", default_value_t = 16)]
    pub db_max_connections: u32,
    /// How long a call waits for a free connection before it is answered UNAVAILABLE.
    #[arg(long, env = "IDEMPOTENCY_DB_ACQUIRE_TIMEOUT", default_value = "2s", value_parser = humantime::parse_duration)]
    pub db_acquire_timeout: Duration,
    /// Longest a single statement may run (Postgres statement_timeout). The
    /// server waits this plus 1 s for a statement's answer, then answers
    /// UNAVAILABLE and closes the connection (a frozen database never times
    /// a statement out itself).
    #[arg(long, env = "IDEMPOTENCY_STATEMENT_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
    pub statement_timeout: Duration,
}

impl DatabaseArgs {
    /// The URL, given or read from its file (each call reads the file).
    pub fn url(&self) -> Result<DatabaseUrl, DatabaseUrlError> {
        match (&self.database_url, &self.database_url_file) {
            (Some(url), None) => Ok(url.clone()),
            (None, Some(path)) => DatabaseUrl::from_file(path),
            (Some(_), Some(_)) => Err(DatabaseUrlError::Both),
            (None, None) => Err(DatabaseUrlError::Missing),
        }
    }

    pub fn connect_options(&self) -> Result<sqlx::postgres::PgConnectOptions, DatabaseUrlError> {
        self.url()?.connect_options()
    }

    pub fn pool_settings(&self) -> PoolSettings {
        PoolSettings {
            max_connections: self.db_max_connections,
            acquire_timeout: self.db_acquire_timeout,
            statement_timeout: self.statement_timeout,
            index_lookups_only: true,
        }
    }
}

#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Log filter, e.g. `info` or `idempotency_server=debug,sqlx=warn`.
    /// Audit lines (target `audit`) are kept unless the filter names `audit`.
    #[arg(
        long,
        env = "IDEMPOTENCY_LOG_LEVEL",
        default_value = "info",
        global = true
    )]
    pub log_level: String,
    /// Log line format.
    #[arg(long, env = "IDEMPOTENCY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_threads_default_to_the_runtime_and_refuse_zero() {
        let serve = |extra: &[&str]| {
            let args = ["serve", "--database-url", "postgres://db/x"];
            Settings::try_parse_from(args.iter().chain(extra))
        };
        assert_eq!(serve(&[]).unwrap().worker_threads, None);
        assert_eq!(
            serve(&["--worker-threads", "1"]).unwrap().worker_threads,
            std::num::NonZeroUsize::new(1)
        );
        let zero = serve(&["--worker-threads", "0"]).unwrap_err().to_string();
        assert!(zero.contains("--worker-threads"), "{zero}");
    }

    #[test]
    fn background_periods_and_reaper_limits_refuse_zero() {
        let serve = |extra: &[&str]| {
            let args = ["serve", "--database-url", "postgres://db/x"];
            Settings::try_parse_from(args.iter().chain(extra))
        };
        for (flag, zero) in [
            ("--health-check-interval", "0s"),
            ("--stats-interval", "0s"),
            ("--reaper-interval", "0ms"),
            ("--reaper-batch-size", "0"),
            ("--reaper-max-per-run", "0"),
        ] {
            let error = serve(&[flag, zero]).unwrap_err().to_string();
            assert!(error.contains(flag), "{flag} {zero}: {error}");
        }
        let args = serve(&["--reaper-interval", "1s", "--reaper-batch-size", "1"]).unwrap();
        assert_eq!(args.reaper.reaper_interval, Duration::from_secs(1));
        assert_eq!(args.reaper.reaper_batch_size, 1);
    }

    #[test]
    fn connection_flags_default_to_the_connection_settings_defaults() {
        let args = serve_without_env(&["serve", "--database-url", "postgres://db/x"]).unwrap();
        assert_eq!(
            args.connections.settings(),
            crate::grpc::connections::ConnectionSettings::default()
        );
        let zero = serve_without_env(&[
            "serve",
            "--database-url",
            "postgres://db/x",
            "--max-connections",
            "0",
        ]);
        assert!(zero.unwrap_err().to_string().contains("--max-connections"));
    }

    /// The settings types keep `Default` impls of their own (the tests build
    /// servers and stores from them without flags): each must be what the
    /// flags give by default, so that a default changed in one place fails
    /// here instead of drifting.
    #[test]
    fn flag_defaults_are_the_settings_types_defaults() {
        let settings = serve_without_env(&["serve", "--database-url", "postgres://db/x"]).unwrap();
        assert_eq!(settings.limits(), Limits::default());
        assert_eq!(settings.database.pool_settings(), PoolSettings::default());
        assert_eq!(settings.batch_settings(), Some(BatchSettings::default()));
        assert_eq!(
            settings.replay_cache_settings(),
            Some(ReplayCacheSettings::default())
        );
        assert_eq!(settings.reaper_settings(), Some(ReaperSettings::default()));
        assert_eq!(settings.reaper.settings().limits, ReapLimits::default());
    }

    /// The `serve` command line alone: the tests run where DATABASE_URL is set.
    fn serve_without_env(args: &[&str]) -> Result<Settings, clap::Error> {
        let (serve, flags) = args.split_first().expect("the command's name");
        assert_eq!(*serve, "serve");
        Settings::from_flags(flags)
    }

    #[test]
    fn the_database_url_comes_from_exactly_one_of_the_flag_and_the_file() {
        let url = "postgres://idem:SecretTail@db/x";
        let file = std::env::temp_dir().join(format!("settings-url-{}", std::process::id()));
        std::fs::write(&file, format!("{url}\n")).unwrap();
        let path = file.to_str().unwrap();

        let from_flag = serve_without_env(&["serve", "--database-url", url]).unwrap();
        let from_file = serve_without_env(&["serve", "--database-url-file", path]).unwrap();
        let read = from_file.database.url().unwrap();
        let both =
            serve_without_env(&["serve", "--database-url", url, "--database-url-file", path])
                .unwrap_err();
        let neither = serve_without_env(&["serve"]).unwrap_err();
        std::fs::remove_file(&file).unwrap();
        let gone = from_file.database.url().unwrap_err().to_string();

        assert_eq!(from_flag.database.url().unwrap().expose(), url);
        assert_eq!(read.expose(), url);
        assert!(
            gone.contains(path) && !gone.contains("SecretTail"),
            "{gone}"
        );
        let both = both.to_string();
        assert!(both.contains("--database-url-file"), "{both}");
        assert!(!both.contains("SecretTail"), "{both}");
        let neither = neither.to_string();
        assert!(
            neither.contains("--database-url") && neither.contains("--database-url-file"),
            "{neither}"
        );
        let debug = format!("{from_flag:?}");
        assert!(!debug.contains("SecretTail"), "{debug}");
    }

    #[test]
    fn help_never_shows_the_database_url() {
        use clap::CommandFactory;
        let help = Settings::command().render_long_help().to_string();
        assert!(help.contains("--database-url-file <PATH>"), "{help}");
        // Where the tests run, DATABASE_URL is usually set.
        if let Ok(url) = std::env::var("DATABASE_URL") {
            assert!(!help.contains(&url), "{help}");
        }
    }

    #[test]
    fn cli_is_well_formed() {
        use clap::CommandFactory;
        <Cli as CommandFactory>::command().debug_assert();
    }
}
