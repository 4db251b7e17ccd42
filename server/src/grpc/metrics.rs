//! Per-call metrics. The guard records on drop, so a call whose client went
//! away (its future dropped mid-flight) is still counted, as `cancelled`.

use std::time::Instant;

use tonic::Code;

use crate::domain::AcquireOutcome;

pub const REQUESTS_TOTAL: &str = "idempotency_requests_total";
pub const REQUEST_DURATION_SECONDS: &str = "idempotency_request_duration_seconds";

/// Registers HELP text so `/metrics` is self-describing.
pub fn describe() {
    metrics::describe_counter!(
        REQUESTS_TOTAL,
        "gRPC calls answered, by RPC and outcome (cancelled: the caller went away)."
    );
    metrics::describe_histogram!(
        REQUEST_DURATION_SECONDS,
        metrics::Unit::Seconds,
        "Time to answer a gRPC call, by RPC and outcome."
    );
}

/// Times one call and counts it under its outcome.
pub struct CallMetrics {
    rpc: &'static str,
    started: Instant,
    outcome: &'static str,
}

impl CallMetrics {
    pub fn start(rpc: &'static str) -> Self {
        Self {
            rpc,
            started: Instant::now(),
            outcome: "cancelled",
        }
    }

    /// Records how the call ended: `ok`, an Acquire outcome, or the error's code.
    pub fn finish<T>(&mut self, result: &Result<T, tonic::Status>, success: &'static str) {
        self.outcome = match result {
            Ok(_) => success,
            Err(status) => code_outcome(status.code()),
        };
    }
}

impl Drop for CallMetrics {
    fn drop(&mut self) {
        let labels = [("rpc", self.rpc), ("outcome", self.outcome)];
        metrics::counter!(REQUESTS_TOTAL, &labels).increment(1);
        metrics::histogram!(REQUEST_DURATION_SECONDS, &labels)
            .record(self.started.elapsed().as_secs_f64());
    }
}

pub fn acquire_outcome(outcome: &AcquireOutcome) -> &'static str {
    match outcome {
        AcquireOutcome::Acquired { .. } => "acquired",
        AcquireOutcome::InProgress { .. } => "in_progress",
        AcquireOutcome::Completed { .. } => "completed",
        AcquireOutcome::Failed { .. } => "failed",
        AcquireOutcome::FingerprintMismatch => "fingerprint_mismatch",
    }
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
        _ => "internal",
    }
}
