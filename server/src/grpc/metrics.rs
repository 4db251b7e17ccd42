//! Per-call metrics. The guard records on drop, so a call whose client went
//! away (its future dropped mid-flight) is still counted, as `cancelled`.
//! It also fills in a unary call's span (see [`super::trace`]): its
//! namespace and outcome. A batch's items each have their own, so they
//! leave the span to the batch (`super::service`), which names its
//! namespaces there once.

use std::time::Instant;

use metrics::SharedString;
use tonic::Code;

use crate::{
    domain::AcquireOutcome,
    metrics::{
        BATCH_ITEMS, FINGERPRINT_MISMATCHES_TOTAL, INVALID_NAMESPACE, LEASE_TAKEOVERS_TOTAL,
        NamespaceLabels, REPLAYS_TOTAL, REQUEST_DURATION_SECONDS, REQUESTS_TOTAL,
    },
};

/// Times one call and counts it under its outcome and namespace.
pub struct CallMetrics<'a> {
    rpc: &'static str,
    started: Instant,
    outcome: &'static str,
    labels: &'a NamespaceLabels,
    namespace: SharedString,
    /// An item of a batch call, whose outcome is not the call's.
    item: bool,
}

impl<'a> CallMetrics<'a> {
    pub fn start(rpc: &'static str, labels: &'a NamespaceLabels) -> Self {
        Self {
            rpc,
            started: Instant::now(),
            outcome: "cancelled",
            labels,
            namespace: SharedString::const_str(INVALID_NAMESPACE),
            item: false,
        }
    }

    /// Times and counts one item of a batch call.
    pub fn start_item(rpc: &'static str, labels: &'a NamespaceLabels) -> Self {
        let mut call = Self::start(rpc, labels);
        call.item = true;
        call
    }

    /// The RPC being counted.
    pub fn rpc(&self) -> &'static str {
        self.rpc
    }

    /// Names the caller's namespace once the request parsed.
    pub fn namespace(&mut self, namespace: &str) {
        self.namespace = self.labels.label(namespace);
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
        let namespace = self.namespace.clone();
        self.outcome = match outcome {
            AcquireOutcome::Acquired { takeover, .. } => {
                if *takeover {
                    metrics::counter!(LEASE_TAKEOVERS_TOTAL, "namespace" => namespace).increment(1);
                }
                "acquired"
            }
            AcquireOutcome::InProgress { .. } => "in_progress",
            AcquireOutcome::Completed { .. } => {
                metrics::counter!(REPLAYS_TOTAL, "namespace" => namespace).increment(1);
                "completed"
            }
            AcquireOutcome::Failed { .. } => {
                metrics::counter!(REPLAYS_TOTAL, "namespace" => namespace).increment(1);
                "failed"
            }
            AcquireOutcome::FingerprintMismatch => {
                metrics::counter!(FINGERPRINT_MISMATCHES_TOTAL, "namespace" => namespace)
                    .increment(1);
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
        metrics::counter!(
            REQUESTS_TOTAL,
            "rpc" => self.rpc,
            "outcome" => self.outcome,
            "namespace" => self.namespace.clone()
        )
        .increment(1);
        metrics::histogram!(REQUEST_DURATION_SECONDS, "rpc" => self.rpc, "outcome" => self.outcome)
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
