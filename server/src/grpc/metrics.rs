//! Per-call metrics. The guard records on drop, so a call whose client went
//! away (its future dropped mid-flight) is still counted, as `cancelled`.
//! It also fills in a unary call's span (see [`super::trace`]): its
//! namespace and outcome. A batch's items each have their own, so they
//! leave the span to the batch (`super::service`), which names its
//! namespaces there once.

use std::{
    collections::HashMap,
    hash::Hash,
    sync::{Arc, PoisonError, RwLock},
    time::Instant,
};

use metrics::{Counter, Histogram, SharedString};
use tonic::Code;

use crate::{
    domain::AcquireOutcome,
    metrics::{
        BATCH_ITEMS, FINGERPRINT_MISMATCHES_TOTAL, INVALID_NAMESPACE, LEASE_TAKEOVERS_TOTAL,
        NamespaceLabels, REPLAYS_TOTAL, REQUEST_DURATION_SECONDS, REQUESTS_TOTAL,
    },
    telemetry::MetricsRecorder,
};

/// The series every call counts in, each registered with the recorder once.
///
/// `counter!` and `histogram!` with labels build the series' key (a vector
/// of labels) and look it up in the recorder's registry on every use: about
/// 5 % of the server's CPU at 256 callers, and an allocation per call. Here
/// a call finds its handle by its labels instead. The set stays bounded:
/// RPCs and outcomes are fixed names, namespaces capped by
/// [`NamespaceLabels`].
#[derive(Clone)]
pub struct CallSeries {
    labels: NamespaceLabels,
    handles: Arc<Handles>,
}

/// A counter's name and labels: the metric, the RPC and the outcome (empty
/// for the per-namespace event counters, which have neither), the namespace.
type CounterKey = (&'static str, &'static str, &'static str, SharedString);

/// A cheap hasher: the keys' namespaces are capped and already validated,
/// so no caller can fill a map with colliding keys (and foldhash is seeded
/// per process anyway).
type Fast = foldhash::fast::RandomState;

#[derive(Default)]
struct Handles {
    counters: RwLock<HashMap<CounterKey, Counter, Fast>>,
    /// By RPC and outcome.
    durations: RwLock<HashMap<(&'static str, &'static str), Histogram, Fast>>,
}

impl CallSeries {
    /// Handles registered later go to the installed recorder (a handle
    /// registered before it was installed would record nowhere, for good).
    pub fn new(labels: NamespaceLabels, _installed: &MetricsRecorder) -> Self {
        Self {
            labels,
            handles: Arc::default(),
        }
    }

    fn requests(
        &self,
        rpc: &'static str,
        outcome: &'static str,
        namespace: &SharedString,
    ) -> Counter {
        let key = (REQUESTS_TOTAL, rpc, outcome, namespace.clone());
        kept(
            &self.handles.counters,
            key,
            |(name, rpc, outcome, namespace)| metrics::counter!(*name, "rpc" => *rpc, "outcome" => *outcome, "namespace" => namespace.clone()),
        )
    }

    /// One of the counters of events by namespace (replays, takeovers, …).
    fn event(&self, name: &'static str, namespace: &SharedString) -> Counter {
        let key = (name, "", "", namespace.clone());
        kept(
            &self.handles.counters,
            key,
            |(name, _, _, namespace)| metrics::counter!(*name, "namespace" => namespace.clone()),
        )
    }

    fn duration(&self, rpc: &'static str, outcome: &'static str) -> Histogram {
        kept(
            &self.handles.durations,
            (rpc, outcome),
            |(rpc, outcome)| metrics::histogram!(REQUEST_DURATION_SECONDS, "rpc" => *rpc, "outcome" => *outcome),
        )
    }
}

impl std::fmt::Debug for CallSeries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallSeries")
            .field("labels", &self.labels)
            .finish_non_exhaustive()
    }
}

/// The handle under `key`, registered by `register` the first time.
fn kept<K: Hash + Eq, V: Clone>(
    handles: &RwLock<HashMap<K, V, Fast>>,
    key: K,
    register: impl FnOnce(&K) -> V,
) -> V {
    // Read-mostly: after the first calls every call takes only the read lock.
    if let Some(handle) = handles
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&key)
    {
        return handle.clone();
    }
    handles
        .write()
        .unwrap_or_else(PoisonError::into_inner)
        .entry(key)
        .or_insert_with_key(register)
        .clone()
}

/// Times one call and counts it under its outcome and namespace.
pub struct CallMetrics<'a> {
    rpc: &'static str,
    started: Instant,
    outcome: &'static str,
    series: &'a CallSeries,
    namespace: SharedString,
    /// An item of a batch call, whose outcome is not the call's.
    item: bool,
}

impl<'a> CallMetrics<'a> {
    pub fn start(rpc: &'static str, series: &'a CallSeries) -> Self {
        Self {
            rpc,
            started: Instant::now(),
            outcome: "cancelled",
            series,
            namespace: SharedString::const_str(INVALID_NAMESPACE),
            item: false,
        }
    }

    /// Times and counts one item of a batch call.
    pub fn start_item(rpc: &'static str, series: &'a CallSeries) -> Self {
        let mut call = Self::start(rpc, series);
        call.item = true;
        call
    }

    /// The RPC being counted.
    pub fn rpc(&self) -> &'static str {
        self.rpc
    }

    /// Names the caller's namespace once the request parsed.
    pub fn namespace(&mut self, namespace: &str) {
        self.namespace = self.series.labels.label(namespace);
        if !self.item {
            tracing::Span::current().record("namespace", namespace);
        }
    }

    /// Records how the call ended: `ok`, or the error's code.
    pub fn finish<T>(&mut self, result: &Result<T, tonic::Status>) {
        self.outcome = match result {
            Ok(_) => "ok",
            Err(status) => code_outcome(status.code()),
        };
    }

    /// Records an Acquire's outcome, and the events behind it.
    pub fn acquire_outcome(&mut self, outcome: &AcquireOutcome) {
        let event = |name| self.series.event(name, &self.namespace).increment(1);
        self.outcome = match outcome {
            AcquireOutcome::Acquired { takeover, .. } => {
                if *takeover {
                    event(LEASE_TAKEOVERS_TOTAL);
                }
                "acquired"
            }
            AcquireOutcome::InProgress { .. } => "in_progress",
            AcquireOutcome::Completed { .. } => {
                event(REPLAYS_TOTAL);
                "completed"
            }
            AcquireOutcome::Failed { .. } => {
                event(REPLAYS_TOTAL);
                "failed"
            }
            AcquireOutcome::FingerprintMismatch => {
                event(FINGERPRINT_MISMATCHES_TOTAL);
                "fingerprint_mismatch"
            }
        };
    }
}

impl Drop for CallMetrics<'_> {
    fn drop(&mut self) {
        if !self.item {
            tracing::Span::current().record("outcome", self.outcome);
        }
        self.series
            .requests(self.rpc, self.outcome, &self.namespace)
            .increment(1);
        self.series
            .duration(self.rpc, self.outcome)
            .record(self.started.elapsed().as_secs_f64());
    }
}

/// Records the size of an accepted batch call (its items count as unary calls).
pub fn record_batch_items(rpc: &'static str, items: usize) {
    metrics::histogram!(BATCH_ITEMS, "rpc" => rpc).record(items as f64);
}

fn code_outcome(code: Code) -> &'static str {
    match code {
        Code::Ok => "ok",
        Code::InvalidArgument => "invalid_argument",
        Code::NotFound => "not_found",
        Code::Aborted => "aborted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Unavailable => "unavailable",
        Code::Cancelled => "cancelled",
        Code::Unauthenticated => "unauthenticated",
        Code::PermissionDenied => "permission_denied",
        _ => "internal",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The handles kept per series still count where the recorder exports:
    /// each call once, under its own labels, an event by namespace (a
    /// fingerprint mismatch) too, and a namespace beyond the cap under
    /// `_other`. (The recorder is the process's; the RPC name
    /// keeps these series apart from other tests'.)
    #[test]
    fn calls_count_in_their_own_series() {
        let recorder = MetricsRecorder::install();
        let series = CallSeries::new(NamespaceLabels::new(1), &recorder);
        for (namespace, result) in [
            ("series-a", Ok(())),
            ("series-a", Ok(())),
            ("series-b", Ok(())),
            ("series-a", Err(tonic::Status::not_found("absent"))),
        ] {
            let mut call = CallMetrics::start("SeriesTest", &series);
            call.namespace(namespace);
            call.finish(&result);
        }
        drop(CallMetrics::start("SeriesTest", &series));
        let mut mismatch = CallMetrics::start("SeriesTest", &series);
        mismatch.namespace("series-a");
        mismatch.acquire_outcome(&AcquireOutcome::FingerprintMismatch);
        drop(mismatch);

        let text = recorder.handle().render();
        let requests = |outcome: &str, namespace: &str| {
            format!(
                "idempotency_requests_total{{rpc=\"SeriesTest\",outcome=\"{outcome}\",namespace=\"{namespace}\"}}"
            )
        };
        for (line, count) in [
            (requests("ok", "series-a"), 2),
            (requests("ok", "_other"), 1),
            (requests("not_found", "series-a"), 1),
            (requests("cancelled", "_invalid"), 1),
            (requests("fingerprint_mismatch", "series-a"), 1),
            (
                "idempotency_fingerprint_mismatches_total{namespace=\"series-a\"}".to_owned(),
                1,
            ),
            (
                "idempotency_request_duration_seconds_count{rpc=\"SeriesTest\",outcome=\"ok\"}"
                    .to_owned(),
                3,
            ),
        ] {
            assert!(
                text.lines().any(|l| l == format!("{line} {count}")),
                "no `{line} {count}` in:\n{text}"
            );
        }
    }
}
