//! The metrics catalogue: every name the service exports, described in one
//! place so `/metrics` carries HELP lines, and the cap on caller-supplied labels.
//!
//! Names follow `idempotency_<noun>_<unit>`; label sets are bounded.

use std::{
    collections::HashSet,
    sync::{Arc, OnceLock, RwLock},
    time::Instant,
};

use metrics::{
    Histogram, SharedString, Unit, describe_counter, describe_gauge, describe_histogram,
};

use crate::telemetry::MetricsRecorder;

// Calls.
pub const REQUESTS_TOTAL: &str = "idempotency_requests_total";
pub const REQUEST_DURATION_SECONDS: &str = "idempotency_request_duration_seconds";
pub const BATCH_ITEMS: &str = "idempotency_batch_items";
pub const REQUEST_TIMEOUTS_TOTAL: &str = "idempotency_request_timeouts_total";
pub const IN_FLIGHT_BYTES: &str = "idempotency_in_flight_bytes";
pub const IN_FLIGHT_BYTES_LIMIT: &str = "idempotency_in_flight_bytes_limit";
pub const ADMISSION_REFUSED_TOTAL: &str = "idempotency_admission_refused_total";

// Connections.
pub const GRPC_CONNECTIONS: &str = "idempotency_grpc_connections";
pub const GRPC_CONNECTIONS_CLOSED_TOTAL: &str = "idempotency_grpc_connections_closed_total";
pub const GRPC_CALLS_IN_FLIGHT: &str = "idempotency_grpc_calls_in_flight";
pub const GRPC_CALLS_REFUSED_TOTAL: &str = "idempotency_grpc_calls_refused_total";
pub const GRPC_STREAMS_OPEN: &str = "idempotency_grpc_streams_open";
pub const GRPC_STREAM_MESSAGES_IN_FLIGHT: &str = "idempotency_grpc_stream_messages_in_flight";
pub const GRPC_STREAMS_REFUSED_TOTAL: &str = "idempotency_grpc_streams_refused_total";
pub const GRPC_STREAMS_ENDED_TOTAL: &str = "idempotency_grpc_streams_ended_total";

// The database.
pub const DB_QUERY_DURATION_SECONDS: &str = "idempotency_db_query_duration_seconds";
pub const DB_POOL_CONNECTIONS: &str = "idempotency_db_pool_connections";
pub const DB_POOL_MAX_CONNECTIONS: &str = "idempotency_db_pool_max_connections";
pub const DB_POOL_WAIT_SECONDS: &str = "idempotency_db_pool_wait_seconds";
pub const DB_BATCH_SIZE: &str = "idempotency_db_batch_size";
pub const DB_CALLS_ALONE_TOTAL: &str = "idempotency_db_calls_alone_total";
pub const DB_CONNECTIONS_ABANDONED_TOTAL: &str = "idempotency_db_connections_abandoned_total";
pub const DB_CONNECTIONS_READ_ONLY_TOTAL: &str = "idempotency_db_connections_read_only_total";
pub const DATABASE_UP: &str = "idempotency_database_up";
pub const DATABASE_PROBE_DURATION_SECONDS: &str = "idempotency_database_probe_duration_seconds";
pub const DATABASE_PROBES_TOTAL: &str = "idempotency_database_probes_total";

// Records.
pub const REPLAYS_TOTAL: &str = "idempotency_replays_total";
pub const REPLAY_CACHE_LOOKUPS_TOTAL: &str = "idempotency_replay_cache_lookups_total";
pub const FINGERPRINT_MISMATCHES_TOTAL: &str = "idempotency_fingerprint_mismatches_total";
pub const LEASE_TAKEOVERS_TOTAL: &str = "idempotency_lease_takeovers_total";
pub const TABLE_BYTES: &str = "idempotency_table_bytes";
pub const RECORDS: &str = "idempotency_records";
pub const REAPER_BACKLOG_SECONDS: &str = "idempotency_reaper_backlog_seconds";
pub const REAPER_DELETED_TOTAL: &str = "idempotency_reaper_deleted_total";
pub const REAPER_RUNS_TOTAL: &str = "idempotency_reaper_runs_total";
pub const REAPER_DURATION_SECONDS: &str = "idempotency_reaper_duration_seconds";
pub const REAPER_LAST_SUCCESS_TIMESTAMP_SECONDS: &str =
    "idempotency_reaper_last_success_timestamp_seconds";

// Security.
pub const AUTH_MODE: &str = "idempotency_auth_mode";
pub const AUTH_DENIED_TOTAL: &str = "idempotency_auth_denied_total";
pub const CONFIG_RELOADS_TOTAL: &str = "idempotency_config_reloads_total";
pub const CONFIG_FILE_VALID: &str = "idempotency_config_file_valid";
pub const TLS_CERTIFICATE_EXPIRY_SECONDS: &str =
    "idempotency_tls_certificate_expiry_timestamp_seconds";

/// Registers the HELP text of every metric, area by area.
pub fn describe() {
    describe_calls();
    describe_connections();
    describe_database();
    describe_records();
    describe_security();
}

/// The calls: answered, refused before decoding, timed out, and the memory they hold.
fn describe_calls() {
    describe_counter!(
        REQUESTS_TOTAL,
        "gRPC calls answered, by RPC, outcome (cancelled: the caller went away) and namespace. \
         Each item of a batch call counts as its unary RPC."
    );
    describe_histogram!(
        REQUEST_DURATION_SECONDS,
        Unit::Seconds,
        "Time to answer a gRPC call, by RPC and outcome."
    );
    describe_histogram!(
        BATCH_ITEMS,
        "Items per BatchAcquire or BatchComplete call, by RPC. Each item also counts in \
         idempotency_requests_total as its unary RPC (Acquire, Complete)."
    );
    describe_counter!(
        REQUEST_TIMEOUTS_TOTAL,
        "Calls answered at their deadline (the caller's grpc-timeout or --request-timeout) \
         before the work behind them finished, by RPC."
    );
    describe_gauge!(
        IN_FLIGHT_BYTES,
        Unit::Bytes,
        "Memory charged to the calls in flight: their messages, replies and a fixed cost each."
    );
    describe_gauge!(
        IN_FLIGHT_BYTES_LIMIT,
        Unit::Bytes,
        "The budget of idempotency_in_flight_bytes (--max-in-flight-bytes); calls past it are shed."
    );
    describe_counter!(
        ADMISSION_REFUSED_TOTAL,
        "Calls refused before their message was decoded, by reason: overloaded (shed at the \
         memory budget), message_too_large, too_many_items, too_many_headers."
    );
}

/// The gRPC port's connections and calls in flight, and their caps.
fn describe_connections() {
    describe_gauge!(
        GRPC_CONNECTIONS,
        "Client connections open on the gRPC port, those still in their handshake included \
         (at most --max-connections)."
    );
    describe_counter!(
        GRPC_CONNECTIONS_CLOSED_TOTAL,
        "gRPC port connections the server closed before serving a call, by reason: refused \
         (--max-connections were open), handshake_timeout (no TLS handshake and HTTP/2 preface \
         within --handshake-timeout)."
    );
    describe_gauge!(
        GRPC_CALLS_IN_FLIGHT,
        "gRPC calls in flight across every connection, until their answer is ready \
         (at most --max-concurrent-calls)."
    );
    describe_counter!(
        GRPC_CALLS_REFUSED_TOTAL,
        "gRPC calls answered UNAVAILABLE (reason OVERLOADED) at once because \
         --max-concurrent-calls calls were in flight."
    );
    describe_gauge!(
        GRPC_STREAMS_OPEN,
        "BatchStream calls open (at most --max-streams)."
    );
    describe_gauge!(
        GRPC_STREAM_MESSAGES_IN_FLIGHT,
        "BatchStream messages read and not yet answered on the wire, across every stream \
         (at most --stream-max-in-flight per stream). Each is also a call in \
         idempotency_grpc_calls_in_flight while it is served."
    );
    describe_counter!(
        GRPC_STREAMS_REFUSED_TOTAL,
        "BatchStream calls refused at open, by reason: overloaded (--max-streams were open), \
         too_many_streams (the connection's or principal's limit), unauthenticated, \
         bad_message (not gRPC, or compressed)."
    );
    describe_counter!(
        GRPC_STREAMS_ENDED_TOTAL,
        "BatchStream calls ended, by reason: closed (by the caller, every message answered), \
         idle, max_age, draining (every message answered), drain_timeout, unauthenticated, \
         slow_reader, overloaded, bad_message (too large, compressed or not protobuf), \
         cancelled (the caller went away)."
    );
}

/// Statements, the pool and group commit; the health probe of the database.
fn describe_database() {
    describe_histogram!(
        DB_QUERY_DURATION_SECONDS,
        Unit::Seconds,
        "Time of one database statement, by query, including the wait for a connection."
    );
    describe_gauge!(
        DB_POOL_CONNECTIONS,
        "Open database connections, by state (idle, in_use)."
    );
    describe_gauge!(
        DB_POOL_MAX_CONNECTIONS,
        "Most database connections the pool may open."
    );
    describe_histogram!(
        DB_POOL_WAIT_SECONDS,
        Unit::Seconds,
        "Time a statement waited for a free database connection."
    );
    describe_histogram!(
        DB_BATCH_SIZE,
        "Calls sharing one statement (group commit), by query."
    );
    describe_counter!(
        DB_CALLS_ALONE_TOTAL,
        "Calls a shared statement handed back to run alone, by query: their row was held by \
         another session, or the statement failed for its rows' sake (lock timeout, \
         serialization failure, deadlock)."
    );
    describe_counter!(
        DB_CONNECTIONS_ABANDONED_TOTAL,
        "Database connections closed because a statement on them did not end: no answer within \
         the statement timeout plus a second (a frozen database), or its caller went away."
    );
    describe_counter!(
        DB_CONNECTIONS_READ_ONLY_TOTAL,
        "Database connections closed because the server behind them refused a write as \
         read-only (SQLSTATE 25006): a standby, e.g. an old primary after a failover. The next \
         call connects anew."
    );
    describe_gauge!(
        DATABASE_UP,
        "1 when the last health probe got an answer from the database (SERVING), else 0."
    );
    describe_histogram!(
        DATABASE_PROBE_DURATION_SECONDS,
        Unit::Seconds,
        "Time of a health probe round (connect, look up a key, close, retries included). A round \
         still unanswered at half the health check interval counts as a failure: a p99 near \
         that limit means health is about to flap."
    );
    describe_counter!(
        DATABASE_PROBES_TOTAL,
        "Health probe rounds by result: success, timeout (no answer: frozen, locked, overloaded) \
         or error (every attempt failed: refused, out of connection slots, authentication)."
    );
}

/// What the records go through: replays, takeovers, the table, the reaper.
fn describe_records() {
    describe_counter!(
        REPLAYS_TOTAL,
        "Acquires answered with a stored response (completed or failed)."
    );
    describe_counter!(
        REPLAY_CACHE_LOOKUPS_TOTAL,
        "Acquires looked up in the in-memory cache of finished records, by result (hit, miss)."
    );
    describe_counter!(
        FINGERPRINT_MISMATCHES_TOTAL,
        "Acquires refused because the key was used with another request."
    );
    describe_counter!(
        LEASE_TAKEOVERS_TOTAL,
        "Acquires that took over a lease that had passed: a spike means callers crash or leases are too short."
    );
    describe_gauge!(
        TABLE_BYTES,
        Unit::Bytes,
        "Size of the records table with its indexes and TOAST (pg_total_relation_size)."
    );
    describe_gauge!(
        RECORDS,
        "Records by state: exact for small tables, else estimated from planner statistics."
    );
    describe_gauge!(
        REAPER_BACKLOG_SECONDS,
        Unit::Seconds,
        "Age of the oldest expired record not yet deleted; 0 when there is none."
    );
    describe_counter!(
        REAPER_DELETED_TOTAL,
        "Expired records deleted by the reaper."
    );
    describe_counter!(
        REAPER_RUNS_TOTAL,
        "Reaper runs by result (success, error, skipped: another replica held the lock)."
    );
    describe_histogram!(
        REAPER_DURATION_SECONDS,
        Unit::Seconds,
        "Duration of a reaper run."
    );
    describe_gauge!(
        REAPER_LAST_SUCCESS_TIMESTAMP_SECONDS,
        Unit::Seconds,
        "Unix time of the last successful reaper run in this process."
    );
}

/// The security mode, refused callers, and the security files.
fn describe_security() {
    describe_gauge!(
        AUTH_MODE,
        "1 for the security mode in force: none (no TLS, no auth: anyone who reaches the port \
         may do anything), tls (TLS, no auth), auth (callers authenticated, namespaces enforced)."
    );
    describe_counter!(
        AUTH_DENIED_TOTAL,
        "Calls and batch items refused by authentication or the namespace policy, by reason."
    );
    describe_counter!(
        CONFIG_RELOADS_TOTAL,
        "Changed security files (tls, policy, jwks, static_tokens) read again, by result: \
         success, or error (the last good version stays in force)."
    );
    describe_gauge!(
        CONFIG_FILE_VALID,
        "1 while the security file on disk is the version in force; 0 when its last change did \
         not parse and an older version serves."
    );
    describe_gauge!(
        TLS_CERTIFICATE_EXPIRY_SECONDS,
        Unit::Seconds,
        "Unix time at which the gRPC port's certificate in force expires."
    );
}

/// Creates at zero the counters whose label sets are fixed and small, so that
/// /metrics shows them (and `rate()` over them is 0, not empty) before their
/// first event. Counters labelled by namespace are left out: their label set
/// is the callers'. Adding 0 changes no value, so calling this once per server
/// of a process (tests start many on one recorder) is harmless. Pre-registered
/// (33 series): request timeouts by RPC (7), admission refusals by reason (4),
/// connections closed by reason (2), calls refused (1), calls alone by query
/// (2), abandoned connections (1), health probes by result (3), reaper
/// deletions (1) and runs by result (3), auth denials by reason (8).
/// The label values mirror the call sites' (`grpc::deadline`,
/// `grpc::admission`, `grpc::connections`, `store::records`, `health`,
/// `maintenance`, `security::credentials`, `grpc::auth`).
pub fn register_at_zero(_installed: &MetricsRecorder) {
    let zero = |counter: metrics::Counter| counter.increment(0);
    for rpc in RPCS {
        zero(metrics::counter!(REQUEST_TIMEOUTS_TOTAL, "rpc" => rpc));
    }
    for reason in [
        "overloaded",
        "message_too_large",
        "too_many_items",
        "too_many_headers",
    ] {
        zero(metrics::counter!(ADMISSION_REFUSED_TOTAL, "reason" => reason));
    }
    for reason in ["refused", "handshake_timeout"] {
        zero(metrics::counter!(GRPC_CONNECTIONS_CLOSED_TOTAL, "reason" => reason));
    }
    zero(metrics::counter!(GRPC_CALLS_REFUSED_TOTAL));
    for query in ["acquire", "finish"] {
        zero(metrics::counter!(DB_CALLS_ALONE_TOTAL, "query" => query));
    }
    zero(metrics::counter!(DB_CONNECTIONS_ABANDONED_TOTAL));
    zero(metrics::counter!(DB_CONNECTIONS_READ_ONLY_TOTAL));
    for result in ["success", "timeout", "error"] {
        zero(metrics::counter!(DATABASE_PROBES_TOTAL, "result" => result));
    }
    zero(metrics::counter!(REAPER_DELETED_TOTAL));
    for result in ["success", "error", "skipped"] {
        zero(metrics::counter!(REAPER_RUNS_TOTAL, "result" => result));
    }
    for reason in AUTH_DENIED_REASONS {
        zero(metrics::counter!(AUTH_DENIED_TOTAL, "reason" => reason));
    }
}

/// The service's RPCs, as the `rpc` label names them.
pub(crate) const RPCS: [&str; 7] = [
    "Acquire",
    "Complete",
    "Fail",
    "Renew",
    "Get",
    "BatchAcquire",
    "BatchComplete",
];

/// Every `reason` of `idempotency_auth_denied_total`.
const AUTH_DENIED_REASONS: [&str; 8] = [
    "no_credential",
    "malformed_authorization",
    "unknown_token",
    "token_expired",
    "invalid_token",
    "untrusted_certificate",
    "reflection_forbidden",
    "namespace_forbidden",
];

/// A security file was read at start (`loaded`) or after a change.
pub fn config_file_loaded(kind: &'static str, valid: bool) {
    metrics::gauge!(CONFIG_FILE_VALID, "file" => kind).set(if valid { 1.0 } else { 0.0 });
}

/// A changed security file was read again: in force now, or refused.
pub fn config_reloaded(kind: &'static str, success: bool) {
    let result = if success { "success" } else { "error" };
    metrics::counter!(CONFIG_RELOADS_TOTAL, "file" => kind, "result" => result).increment(1);
    config_file_loaded(kind, success);
}

/// A call or batch item refused by authentication or the policy.
pub fn auth_denied(reason: &'static str) {
    metrics::counter!(AUTH_DENIED_TOTAL, "reason" => reason).increment(1);
}

/// A kind of database statement: the `query` label of
/// `idempotency_db_query_duration_seconds`, and its series, registered on
/// first use and kept. Looking a series up in the recorder (building its
/// key, hashing it, a lock) cost about 3 µs per statement on the hot path
/// (`docs/performance.md`).
pub struct Query {
    name: &'static str,
    duration: OnceLock<Histogram>,
}

impl Query {
    const fn new(name: &'static str) -> Self {
        Self {
            name,
            duration: OnceLock::new(),
        }
    }

    /// Times one statement of this kind.
    pub fn timer(&'static self) -> QueryTimer {
        QueryTimer {
            duration: self.duration(),
            started: Instant::now(),
        }
    }

    fn duration(&'static self) -> &'static Histogram {
        self.duration.get_or_init(|| {
            kept(|| metrics::histogram!(DB_QUERY_DURATION_SECONDS, "query" => self.name))
        })
    }
}

/// Registers a series whose handle is kept, not looked up per use: after
/// the recorder is installed (installing it if need be), as a handle
/// registered before it would record nowhere, for good.
pub fn kept<T>(register: impl FnOnce() -> T) -> T {
    crate::telemetry::metrics_handle();
    register()
}

/// Every kind of statement the service times.
pub mod query {
    use super::Query;

    pub static ACQUIRE: Query = Query::new("acquire");
    pub static FINISH: Query = Query::new("finish");
    pub static TAKE_OVER: Query = Query::new("take_over");
    pub static READ: Query = Query::new("read");
    pub static RELEASE: Query = Query::new("release");
    pub static RENEW: Query = Query::new("renew");
    pub static REAP: Query = Query::new("reap");
    pub static TABLE_STATS: Query = Query::new("table_stats");
}

/// Times a database statement; records on drop, so failed ones count too.
pub struct QueryTimer {
    duration: &'static Histogram,
    started: Instant,
}

impl Drop for QueryTimer {
    fn drop(&mut self) {
        self.duration.record(self.started.elapsed().as_secs_f64());
    }
}

/// The `namespace` label: caller-supplied, so capped. The first `max`
/// namespaces seen keep their name; later ones share `_other`, so a
/// misbehaving caller cannot blow up the number of series.
#[derive(Debug, Clone)]
pub struct NamespaceLabels {
    max: usize,
    /// Shared strings: a label handed out per call is a reference count,
    /// not an allocation.
    seen: Arc<RwLock<HashSet<Arc<str>>>>,
}

/// Label of a call whose namespace could not be read or was refused (an
/// invalid request, a namespace the caller may not use). Reserved: a valid
/// namespace matches `[a-z0-9][a-z0-9._-]*` (`domain::record_id`), so none
/// starts with `_` and no caller can share this series.
pub const INVALID_NAMESPACE: &str = "_invalid";
/// Label shared by namespaces beyond the cap; reserved like [`INVALID_NAMESPACE`].
pub const OTHER_NAMESPACE: &str = "_other";

impl NamespaceLabels {
    pub fn new(max: usize) -> Self {
        Self {
            max,
            seen: Arc::default(),
        }
    }

    /// The label value for `namespace` (already validated).
    pub fn label(&self, namespace: &str) -> SharedString {
        // Read-mostly: after warm-up every call takes only the read lock.
        if let Some(known) = self
            .seen
            .read()
            .expect("label set lock poisoned")
            .get(namespace)
        {
            return SharedString::from(known.clone());
        }
        let mut seen = self.seen.write().expect("label set lock poisoned");
        if let Some(known) = seen.get(namespace) {
            return SharedString::from(known.clone());
        }
        if seen.len() < self.max {
            let label: Arc<str> = Arc::from(namespace);
            seen.insert(label.clone());
            SharedString::from(label)
        } else {
            SharedString::const_str(OTHER_NAMESPACE)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_beyond_the_cap_share_other() {
        let labels = NamespaceLabels::new(2);
        assert_eq!(&*labels.label("a"), "a");
        assert_eq!(&*labels.label("b"), "b");
        assert_eq!(&*labels.label("c"), OTHER_NAMESPACE);
        assert_eq!(&*labels.label("a"), "a");
        assert_eq!(&*labels.label("d"), OTHER_NAMESPACE);
    }

    #[test]
    fn the_reserved_labels_are_no_valid_namespace() {
        for reserved in [INVALID_NAMESPACE, OTHER_NAMESPACE] {
            let id = crate::domain::RecordId::parse(
                "id",
                reserved.into(),
                "op".into(),
                String::new(),
                "abcdefgh".into(),
            );
            assert!(id.is_err(), "{reserved} parses as a namespace");
        }
    }
}
