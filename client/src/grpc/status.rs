//! The layer's own answers, as gRPC statuses with `google.rpc` details: an
//! `ErrorInfo` (domain `idempotency`, a reason per answer) on each, and a
//! `RetryInfo` or `BadRequest` where they help the caller.

use std::time::Duration;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use tonic::body::Body as ResponseBody;

use super::IDEMPOTENCY_KEY;

/// The `ErrorInfo.domain` of every status the layer makes.
pub const ERROR_DOMAIN: &str = "idempotency";

/// `ErrorInfo.reason`s of the layer's statuses.
pub mod reason {
    /// ABORTED: a request with this key is still running; retry after the `RetryInfo` delay.
    pub const IN_PROGRESS: &str = "IDEMPOTENCY_KEY_IN_PROGRESS";
    /// FAILED_PRECONDITION: the key was used with a different request message.
    pub const REUSED: &str = "IDEMPOTENCY_KEY_REUSED";
    /// INVALID_ARGUMENT: the method requires an `idempotency-key` and none was sent.
    pub const MISSING: &str = "IDEMPOTENCY_KEY_MISSING";
    /// INVALID_ARGUMENT: the `idempotency-key` breaks its contract (8-128 printable ASCII, once).
    pub const MALFORMED: &str = "IDEMPOTENCY_KEY_MALFORMED";
    /// INVALID_ARGUMENT: the scope from the request (e.g. its subject) is refused by the service.
    pub const INVALID_SCOPE: &str = "IDEMPOTENCY_SCOPE_INVALID";
    /// INVALID_ARGUMENT: the request message cannot be read or decoded.
    pub const UNDECODABLE: &str = "REQUEST_MESSAGE_UNDECODABLE";
    /// UNIMPLEMENTED: the request message is compressed.
    pub const COMPRESSED: &str = "REQUEST_MESSAGE_COMPRESSED";
    /// RESOURCE_EXHAUSTED: the request is over [`super::super::GrpcConfig::max_request_bytes`].
    pub const TOO_LARGE: &str = "REQUEST_TOO_LARGE";
    /// UNAVAILABLE: the idempotency service cannot be reached (failing closed).
    pub const UNAVAILABLE: &str = "IDEMPOTENCY_UNAVAILABLE";
    /// INTERNAL: the idempotency service refused this service's credentials or namespace.
    pub const NOT_AUTHORIZED: &str = "IDEMPOTENCY_NOT_AUTHORIZED";
    /// INTERNAL: the idempotency service failed otherwise.
    pub const SERVICE_FAILED: &str = "IDEMPOTENCY_SERVICE_FAILED";
    /// INTERNAL (stored): the handler ran, but its response was too large to store.
    pub const NOT_REPLAYABLE: &str = "RESPONSE_NOT_REPLAYABLE";
    /// INTERNAL: the handler's task was cancelled (the server is shutting down).
    pub const HANDLER_CANCELLED: &str = "HANDLER_CANCELLED";
    /// INTERNAL: the handler's response body failed; the key was released.
    pub const HANDLER_FAILED: &str = "HANDLER_RESPONSE_FAILED";
}

/// A status with an `ErrorInfo` of `reason`, and `details` around it.
pub(crate) fn status(code: Code, reason: &str, message: &str, mut details: ErrorDetails) -> Status {
    details.set_error_info(
        reason,
        ERROR_DOMAIN,
        std::collections::HashMap::<String, String>::new(),
    );
    Status::with_error_details(code, message, details)
}

/// A trailers-only response carrying `status`.
pub(crate) fn answer(status: Status) -> http::Response<ResponseBody> {
    status.into_http()
}

pub(crate) fn plain(code: Code, reason: &str, message: &str) -> http::Response<ResponseBody> {
    answer(status(code, reason, message, ErrorDetails::new()))
}

/// INVALID_ARGUMENT naming the `idempotency-key` field.
pub(crate) fn bad_key(reason: &str, message: &str) -> http::Response<ResponseBody> {
    let details = ErrorDetails::with_bad_request_violation(IDEMPOTENCY_KEY, message);
    answer(status(Code::InvalidArgument, reason, message, details))
}

/// ABORTED with a `RetryInfo`: the first request is still running.
pub(crate) fn in_progress(retry_after: Duration) -> http::Response<ResponseBody> {
    let details = ErrorDetails::with_retry_info(Some(retry_after));
    answer(status(
        Code::Aborted,
        reason::IN_PROGRESS,
        "a request with this idempotency-key is still being processed; retry later",
        details,
    ))
}

/// FAILED_PRECONDITION: the request is valid on its own, but conflicts with
/// the state the key is in (it holds another request's answer), and
/// retrying it unchanged never succeeds: not INVALID_ARGUMENT (the request
/// is not malformed) nor ABORTED (a retry does not help).
pub(crate) fn reused() -> http::Response<ResponseBody> {
    plain(
        Code::FailedPrecondition,
        reason::REUSED,
        "this idempotency-key was already used with a different request",
    )
}

/// UNAVAILABLE with a one-second `RetryInfo`: failing closed.
pub(crate) fn unavailable() -> http::Response<ResponseBody> {
    let details = ErrorDetails::with_retry_info(Some(Duration::from_secs(1)));
    answer(status(
        Code::Unavailable,
        reason::UNAVAILABLE,
        "idempotency cannot be guaranteed right now; retry later with the same idempotency-key",
        details,
    ))
}
