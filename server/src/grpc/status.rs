//! The one place where engine errors become gRPC statuses. Each carries a
//! `google.rpc.ErrorInfo` reason (domain `idempotency`) so clients branch on
//! code and reason, never on text; INVALID_ARGUMENT also names the field in a
//! `google.rpc.BadRequest`. Causes are logged here, once; SQL text and
//! database messages never reach the client.

use std::collections::HashMap;

use prost::Message;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::{error::Error, store::StoreError};

/// The `ErrorInfo` domain of every status, and the `ErrorInfo.reason` values
/// (the proto's header lists them for clients): one list, shared with the
/// client through the `idempotency-proto` crate.
pub use idempotency_proto::{ERROR_DOMAIN as DOMAIN, reason};

/// A status with its `ErrorInfo` reason (domain `idempotency`).
pub(crate) fn with_reason(code: Code, message: String, reason: &str) -> Status {
    let details = ErrorDetails::with_error_info(reason, DOMAIN, HashMap::new());
    Status::with_error_details(code, message, details)
}

/// A batch item whose answer would carry the batch's reply past `max_bytes`:
/// the caller sends it again alone, where it fits.
pub fn batch_reply_full(max_bytes: usize) -> Status {
    with_reason(
        Code::ResourceExhausted,
        format!(
            "this item's answer did not fit in the batch's reply ({max_bytes} bytes at most); \
             send it alone"
        ),
        reason::BATCH_REPLY_FULL,
    )
}

/// The `google.rpc.Status` of a failed batch item: exactly what the unary
/// call would have sent in its `grpc-status-details-bin` trailer.
pub fn to_rpc_status(status: &Status) -> tonic_types::pb::Status {
    tonic_types::pb::Status::decode(status.details())
        .ok()
        .filter(|decoded| decoded.code == status.code() as i32)
        .unwrap_or_else(|| tonic_types::pb::Status {
            code: status.code() as i32,
            message: status.message().to_owned(),
            details: Vec::new(),
        })
}

/// Converts an engine error into the status the caller sees. `rpc` goes to the log only.
pub fn to_status(rpc: &'static str, error: Error) -> Status {
    match error {
        Error::InvalidArgument(invalid) => {
            let mut details = ErrorDetails::with_bad_request_violation(
                invalid.field.clone(),
                invalid.description.clone(),
            );
            details.set_error_info(reason::INVALID_ARGUMENT, DOMAIN, HashMap::new());
            Status::with_error_details(Code::InvalidArgument, invalid.to_string(), details)
        }
        Error::NotFound => with_reason(Code::NotFound, error.to_string(), reason::RECORD_NOT_FOUND),
        Error::StaleToken { .. } => with_reason(
            Code::Aborted,
            error.to_string(),
            reason::STALE_FENCING_TOKEN,
        ),
        Error::ResponseConflict { .. } => with_reason(
            Code::FailedPrecondition,
            error.to_string(),
            reason::RESPONSE_CONFLICT,
        ),
        Error::NotInProgress { .. } => with_reason(
            Code::FailedPrecondition,
            error.to_string(),
            reason::NOT_IN_PROGRESS,
        ),
        Error::Contention(_) => {
            tracing::warn!(rpc, error = %error, "gave up after repeated concurrent changes");
            with_reason(
                Code::Unavailable,
                "the record is changing concurrently; retry".into(),
                reason::CONTENTION,
            )
        }
        Error::Store(StoreError::Unavailable(cause)) => {
            tracing::warn!(rpc, error = %cause, "database unavailable");
            with_reason(
                Code::Unavailable,
                "the database is unavailable; retry with backoff".into(),
                reason::DATABASE_UNAVAILABLE,
            )
        }
        Error::Store(store) => {
            tracing::error!(rpc, error = ?store, "internal error");
            with_reason(Code::Internal, "internal error".into(), reason::INTERNAL)
        }
    }
}
