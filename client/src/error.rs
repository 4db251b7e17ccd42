use idempotency_proto::reason;
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
    /// The service did not accept the caller's credentials: no bearer token
    /// or client certificate, or one it rejects (expired, wrong audience,
    /// unknown issuer). Also the error of a call that was never sent because
    /// this client had no token to send (see [`crate::TokenSource`]), which
    /// the message says. Never retried; not a refusal of the request itself
    /// ([`Error::is_refusal`] is false), so nothing is stored in its place.
    #[error("not authenticated by the idempotency service: {message}")]
    Unauthenticated {
        /// The server's explanation, or why no token could be sent.
        message: String,
    },
    /// The service knows the caller but does not let it make this call.
    /// With `reason` [`NAMESPACE_FORBIDDEN`], the record's namespace is not
    /// one this caller may use (in a batch, only the forbidden items fail so).
    /// Never retried, and not a refusal ([`Error::is_refusal`] is false).
    #[error("permission denied by the idempotency service{}: {message}", reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default())]
    PermissionDenied {
        /// The `ErrorInfo` reason, when the answer carried one: the
        /// service's [`NAMESPACE_FORBIDDEN`]; `None` from, e.g., a proxy.
        reason: Option<String>,
        /// The server's explanation.
        message: String,
    },
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
    /// cancelled stream) may pass, so they are not refusals; nor are
    /// [`Error::Unauthenticated`] and [`Error::PermissionDenied`], which are
    /// about the caller, not the request (and storing a failure in place of
    /// the request would be refused alike).
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
            (Code::Unauthenticated, _) => Error::Unauthenticated {
                message: status.message().to_owned(),
            },
            (Code::PermissionDenied, reason) => Error::PermissionDenied {
                reason: reason.map(str::to_owned),
                message: status.message().to_owned(),
            },
            (Code::Aborted, Some(reason::STALE_FENCING_TOKEN)) => Error::LeaseLost,
            (Code::FailedPrecondition, Some(reason::RESPONSE_CONFLICT)) => Error::ResponseConflict,
            (Code::FailedPrecondition, Some(reason::NOT_IN_PROGRESS)) => Error::NotInProgress,
            (code, _) if is_transient(code) => Error::Unavailable {
                attempts,
                message: status.message().to_owned(),
            },
            (Code::Internal, _) => Error::Internal(status.message().to_owned()),
            _ => Error::Unexpected(Box::new(status)),
        }
    }
}

/// The `ErrorInfo` reason of [`Error::PermissionDenied`] when the caller may
/// not use the record's namespace.
pub use idempotency_proto::reason::NAMESPACE_FORBIDDEN;

/// Whether a CANCELLED status is the transport's and not a cancellation:
/// hyper cancels a request it could not send because its connection had
/// closed (a server killed, a proxy restarted, an idle connection dropped
/// by a balancer), and tonic reports that as CANCELLED. The call is
/// transient like any refused connection: the next attempt reconnects.
pub(crate) fn is_dropped_connection(status: &Status) -> bool {
    status.code() == Code::Cancelled
        && causes(status).any(|cause| {
            cause
                .downcast_ref::<hyper::Error>()
                .is_some_and(hyper::Error::is_canceled)
        })
}

/// An error and the errors under it (its `source()`s), outermost first.
pub(crate) fn causes<'a>(
    error: &'a (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(error), |error| error.source())
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
            Error::Unauthenticated {
                message: "token expired".into(),
            },
            Error::PermissionDenied {
                reason: None,
                message: "by a proxy".into(),
            },
            Error::Internal("deadlock".into()),
            Error::Unavailable {
                attempts: 3,
                message: "connection refused".into(),
            },
        ] {
            assert!(!passing.is_refusal(), "{passing}");
        }
    }

    #[test]
    fn a_cancelled_status_without_a_dropped_connection_behind_it_is_not_retried() {
        // What a server or a proxy answers as CANCELLED is theirs to say;
        // only hyper's cancelled request (the test below, and a proxy that
        // drops its connections in tests/) is the transport's.
        assert!(!is_dropped_connection(&Status::cancelled("stream reset")));
        assert!(!is_transient(Code::Cancelled));
        assert!(!is_dropped_connection(&Status::unavailable(
            "connection refused"
        )));
    }

    #[tokio::test]
    async fn a_request_hyper_cancelled_as_its_connection_closed_is_a_dropped_connection() {
        use hyper_util::rt::{TokioExecutor, TokioIo};
        // An HTTP/2 connection whose task is dropped before it ran: the
        // request still waits in its queue, and hyper cancels it unsent, as
        // when a connection closes under requests not yet written.
        let (io, _peer) = tokio::io::duplex(64 * 1024);
        let (mut sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(io))
                .await
                .unwrap();
        let request = hyper::Request::post(
            "http://idempotency.test/idempotency.v1.IdempotencyService/Acquire",
        )
        .body(tonic::body::Body::empty())
        .unwrap();
        let response = sender.send_request(request);
        drop(connection);
        let cancelled = response.await.unwrap_err();
        assert!(cancelled.is_canceled(), "{cancelled:?}");
        // As tonic's `Status::from_error` reports it: CANCELLED, hyper's error behind it.
        let status = Status::from_error(Box::new(cancelled));
        assert_eq!(status.code(), Code::Cancelled, "{status:?}");
        assert!(is_dropped_connection(&status));
    }

    fn forbidden(namespace: &str) -> Status {
        use tonic_types::{ErrorDetails, StatusExt};
        Status::with_error_details(
            Code::PermissionDenied,
            format!("namespace {namespace:?} is not allowed for spiffe://cluster/ns/shop/sa/api"),
            ErrorDetails::with_error_info(NAMESPACE_FORBIDDEN, "idempotency", []),
        )
    }

    #[test]
    fn unauthenticated_and_permission_denied_are_typed_and_never_retried() {
        let unauthenticated = Status::unauthenticated("missing bearer token or client certificate");
        let proxy = Status::permission_denied("RBAC: access denied");
        assert!(!is_transient(unauthenticated.code()) && !is_transient(proxy.code()));

        let unauthenticated = Error::from_status(unauthenticated, 1);
        let forbidden = Error::from_status(forbidden("payments"), 1);
        let proxy = Error::from_status(proxy, 1);

        assert!(
            matches!(&unauthenticated, Error::Unauthenticated { message } if message.contains("bearer")),
            "{unauthenticated:?}"
        );
        assert!(
            matches!(&forbidden, Error::PermissionDenied { reason: Some(reason), message }
                if reason == NAMESPACE_FORBIDDEN && message.contains("payments")),
            "{forbidden:?}"
        );
        assert!(
            matches!(&proxy, Error::PermissionDenied { reason: None, .. }),
            "{proxy:?}"
        );
        assert_eq!(
            forbidden.to_string(),
            "permission denied by the idempotency service (NAMESPACE_FORBIDDEN): namespace \"payments\" is not allowed for spiffe://cluster/ns/shop/sa/api"
        );
        for error in [unauthenticated, forbidden, proxy] {
            assert!(!error.is_unavailable() && !error.is_refusal(), "{error}");
        }
    }

    #[test]
    fn a_forbidden_batch_item_is_a_typed_error_like_its_unary_call() {
        // A batch reply carries each item's google.rpc.Status (what the
        // details of the unary call's status encode).
        use prost::Message;
        let item = tonic_types::pb::Status::decode(forbidden("payments").details()).unwrap();
        let status = crate::batching::item_status(item);

        assert!(matches!(
            Error::from_status(status, 1),
            Error::PermissionDenied { reason: Some(reason), .. } if reason == NAMESPACE_FORBIDDEN
        ));
    }

    #[tokio::test]
    async fn a_rejected_token_or_a_forbidden_namespace_fails_at_once_unary_and_batched() {
        use crate::{
            AcquireRequest, Client, RecordId, TokenSource,
            testing::{EXPIRED_TOKEN, FORBIDDEN_NAMESPACE, FakeService},
        };
        let service = FakeService::plain().await;
        let client = |token: &str| {
            Client::builder()
                .endpoint(format!("http://{}", service.addr))
                .bearer_token(TokenSource::fixed(token))
                .connect_lazy()
                .unwrap()
        };
        let request = |namespace: &str, key: &str| {
            AcquireRequest::new(
                RecordId::new(namespace, "POST /pay", format!("key-{key}")),
                vec![],
            )
        };

        let dir = crate::testing::TempDir::new("no-token");
        let no_token = Client::builder()
            .endpoint(format!("http://{}", service.addr))
            .bearer_token(TokenSource::file(dir.0.join("token")))
            .connect_lazy()
            .unwrap()
            .get(&request("shop", "get").id)
            .await;
        let calls_without_token = service.seen().len();
        let expired = client(EXPIRED_TOKEN).get(&request("shop", "get").id).await;
        let valid = client("valid");
        let forbidden = valid.acquire(&request(FORBIDDEN_NAMESPACE, "alone")).await;
        let calls_unary = service.seen().len();
        // A batch with forbidden and allowed items: only the forbidden fail.
        let mut batch = tokio::task::JoinSet::new();
        for n in 0..6 {
            let namespace = if n % 2 == 0 {
                FORBIDDEN_NAMESPACE
            } else {
                "shop"
            };
            let (client, request) = (valid.clone(), request(namespace, &format!("batch-{n}")));
            batch.spawn(async move {
                (
                    request.id.namespace.clone(),
                    client.acquire(&request).await.map(drop),
                )
            });
        }
        let results = batch.join_all().await;

        assert!(
            matches!(no_token, Err(Error::Unauthenticated { ref message }) if message.contains("token file")),
            "{no_token:?}"
        );
        assert_eq!(
            calls_without_token, 0,
            "a call without its token is not sent"
        );
        assert!(
            matches!(expired, Err(Error::Unauthenticated { ref message }) if message.contains("expired")),
            "{expired:?}"
        );
        assert!(
            matches!(forbidden, Err(Error::PermissionDenied { reason: Some(ref reason), .. }) if reason == NAMESPACE_FORBIDDEN),
            "{forbidden:?}"
        );
        assert_eq!(calls_unary, 2, "never retried: {:?}", service.seen());
        assert!(service.seen().iter().any(|call| call.rpc == "BatchAcquire"));
        for (namespace, result) in results {
            if namespace == FORBIDDEN_NAMESPACE {
                assert!(
                    matches!(result, Err(Error::PermissionDenied { .. })),
                    "{result:?}"
                );
            } else {
                assert!(result.is_ok(), "{result:?}");
            }
        }
    }
}
