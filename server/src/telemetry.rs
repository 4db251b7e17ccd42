//! Logs (tracing) and metrics (Prometheus) set-up.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::{EnvFilter, fmt, fmt::MakeWriter};

use crate::settings::{LogArgs, LogFormat};

/// The log target of audit lines (an operator's `admin purge`).
pub const AUDIT_TARGET: &str = "audit";

/// Installs the global log subscriber, writing to stdout. Call once, first
/// thing in `main`.
pub fn init_logs(args: &LogArgs) {
    init_logs_to(args, std::io::stdout);
}

/// Installs the global log subscriber, writing to `writer`: stderr for the
/// commands whose stdout is their answer (`admin`).
pub fn init_logs_to<W>(args: &LogArgs, writer: W)
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let builder = fmt()
        .with_env_filter(filter(&args.log_level))
        .with_target(true)
        .with_writer(writer);
    match args.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

/// The filter `--log-level` asks for, with audit lines kept whatever the
/// level unless it names the audit target itself.
fn filter(log_level: &str) -> EnvFilter {
    let filter = EnvFilter::try_new(log_level).unwrap_or_else(|error| {
        eprintln!("invalid log level {log_level:?} ({error}); using info");
        EnvFilter::new("info")
    });
    if log_level.contains(AUDIT_TARGET) {
        return filter;
    }
    filter.add_directive(
        format!("{AUDIT_TARGET}=info")
            .parse()
            .expect("a valid directive"),
    )
}

/// Request durations: from 100 µs to 10 s, roughly three buckets per decade.
const DURATION_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// Calls per statement: powers of two up to the largest batch.
const BATCH_SIZE_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// Proof that the process's metrics recorder is installed, and its handle
/// (to render `/metrics`).
///
/// A metric handle registered before the recorder is installed records
/// nowhere, for good, and a gauge set then is lost: whatever registers its
/// handles or sets its gauges once, when it is built (the replay cache's
/// counters, the memory budget's gauges, the security files' gauges), would
/// silently never count. Such a part takes a `&MetricsRecorder` in its
/// constructor, so it cannot be built first.
#[derive(Clone)]
pub struct MetricsRecorder(PrometheusHandle);

impl MetricsRecorder {
    /// Installs the recorder, or finds the one installed (see [`metrics_handle`]).
    pub fn install() -> Self {
        Self(metrics_handle())
    }

    pub fn handle(&self) -> &PrometheusHandle {
        &self.0
    }
}

/// The process-wide Prometheus recorder, installed on first use. A process
/// has one global recorder, so every server in it (tests start many) shares it.
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let handle = PrometheusBuilder::new()
                .set_buckets(DURATION_BUCKETS)
                .expect("bucket list is not empty")
                .set_buckets_for_metric(
                    Matcher::Full(crate::metrics::DB_BATCH_SIZE.to_owned()),
                    BATCH_SIZE_BUCKETS,
                )
                .expect("bucket list is not empty")
                .set_buckets_for_metric(
                    Matcher::Full(crate::metrics::BATCH_ITEMS.to_owned()),
                    BATCH_SIZE_BUCKETS,
                )
                .expect("bucket list is not empty")
                .install_recorder()
                .expect("no other metrics recorder is installed");
            crate::metrics::describe();
            handle
        })
        .clone()
}
