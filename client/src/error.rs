use tonic::{Code, Status};
use tonic_types::StatusExt;

/// Why a call to the idempotency service failed. Chosen by gRPC code and
/// `ErrorInfo` reason, never by message text.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A field of the request is malformed or out of range; nothing was written.
    #[error("invalid argument{}: {message}", field.as_deref().map(|f| format!(" {f}")).unwrap_or_default())]
    InvalidArgument {
        /// The field's path in the request (e.g. `id.key`), when the server named one.
        field: Option<String>,
        /// The server's explanation.
        message: String,
    },
    /// No live record has this id (never created, or expired).
    #[error("no live record has this id")]
    NotFound,
    /// The lease was lost: another attempt took the key over after it ended,
    /// so the business logic may have run twice.
    #[error("lease lost: another attempt took the key over")]
    LeaseLost,
    /// The record is already completed or failed with another response.
    #[error("the record is already finished with a different response")]
    ResponseConflict,
    /// The record is not in progress (finished or released).
    #[error("the record is not in progress")]
    NotInProgress,
    /// The service or its database could not be reached, even after retrying.
    #[error("idempotency service unavailable after {attempts} attempt(s): {message}")]
    Unavailable {
        /// Calls made, the first included.
        attempts: u32,
        /// The last error seen.
        message: String,
    },
    /// The server failed unexpectedly.
    #[error("idempotency service internal error: {0}")]
    Internal(String),
    /// The endpoint or TLS settings are unusable.
    #[error("invalid client configuration: {0}")]
    Config(String),
    /// Any other status, kept whole.
    #[error("unexpected status from the idempotency service: {0}")]
    Unexpected(Box<Status>),
}

impl Error {
    /// True when retrying later may succeed (the service or its database is down).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Error::Unavailable { .. })
    }

    /// True when the service refused the request itself (malformed, or over
    /// a size limit: the service's, or gRPC's message limit, OUT_OF_RANGE):
    /// sending it again cannot succeed. Other unexpected statuses (a
    /// cancelled stream, a proxy's PERMISSION_DENIED) may pass, so they are
    /// not refusals.
    pub fn is_refusal(&self) -> bool {
        match self {
            Error::InvalidArgument { .. } => true,
            Error::Unexpected(status) => status.code() == Code::OutOfRange,
            _ => false,
        }
    }

    pub(crate) fn from_status(status: Status, attempts: u32) -> Self {
        let reason = status.get_details_error_info().map(|info| info.reason);
        match (status.code(), reason.as_deref()) {
            (Code::InvalidArgument, _) => Error::InvalidArgument {
                field: status
                    .get_details_bad_request()
                    .and_then(|bad| bad.field_violations.into_iter().next())
                    .map(|violation| violation.field),
                message: status.message().to_owned(),
            },
            (Code::NotFound, _) => Error::NotFound,
            (Code::Aborted, Some("STALE_FENCING_TOKEN")) => Error::LeaseLost,
            (Code::FailedPrecondition, Some("RESPONSE_CONFLICT")) => Error::ResponseConflict,
            (Code::FailedPrecondition, Some("NOT_IN_PROGRESS")) => Error::NotInProgress,
            (code, _) if is_transient(code) => Error::Unavailable {
                attempts,
                message: status.message().to_owned(),
            },
            (Code::Internal, _) => Error::Internal(status.message().to_owned()),
            _ => Error::Unexpected(Box::new(status)),
        }
    }
}

/// Codes worth retrying: every RPC of the service is idempotent, so a call
/// that may or may not have reached the server can be sent again.
pub(crate) fn is_transient(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable | Code::DeadlineExceeded | Code::ResourceExhausted
        // A connection reset mid-call surfaces as Unknown.
        | Code::Unknown
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_malformed_or_oversized_request_is_a_refusal() {
        let invalid = Error::InvalidArgument {
            field: Some("response.body".into()),
            message: "too large".into(),
        };
        let too_large = Error::Unexpected(Box::new(Status::out_of_range("message too large")));
        assert!(invalid.is_refusal());
        assert!(too_large.is_refusal());
        for passing in [
            Error::Unexpected(Box::new(Status::cancelled("stream reset"))),
            Error::Unexpected(Box::new(Status::permission_denied("by a proxy"))),
            Error::Internal("deadlock".into()),
            Error::Unavailable {
                attempts: 3,
                message: "connection refused".into(),
            },
        ] {
            assert!(!passing.is_refusal(), "{passing}");
        }
    }
}
