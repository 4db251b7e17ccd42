//! Logs (tracing) and metrics (Prometheus) set-up.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::{EnvFilter, fmt};

use crate::settings::{LogArgs, LogFormat};

/// Installs the global log subscriber. Call once, first thing in `main`.
pub fn init_logs(args: &LogArgs) {
    let filter = EnvFilter::try_new(&args.log_level).unwrap_or_else(|error| {
        eprintln!(
            "invalid log level {:?} ({error}); using info",
            args.log_level
        );
        EnvFilter::new("info")
    });
    let builder = fmt().with_env_filter(filter).with_target(true);
    match args.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

/// Request durations: from 100 µs to 10 s, roughly three buckets per decade.
const DURATION_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// Calls per statement: powers of two up to the largest batch.
const BATCH_SIZE_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

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
