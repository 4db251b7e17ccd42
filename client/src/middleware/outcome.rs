//! How a layer's request ends once it holds a key, whatever the protocol:
//! the handler's task, storing its answer, releasing the key, and the
//! service's refusals.

use std::future::Future;

use crate::{Error, Lease, RecordId, StoredResponse};

/// Runs `work` in a task of its own, so that it finishes, and its response
/// is stored, even when the client goes away mid-request: the client's retry
/// then gets "in progress" and later the stored answer, and the handler runs
/// once. (Dropped mid-Acquire instead, the key would stay in progress until
/// its lease passed.) A panic in the handler drops the lease, which releases
/// the key, and is passed on to the caller. `None`: the task was cancelled
/// (the runtime is shutting down).
pub(crate) async fn detached<T: Send + 'static>(
    work: impl Future<Output = T> + Send + 'static,
) -> Option<T> {
    // The task runs in the caller's trace (the request's `traceparent`).
    match tokio::spawn(crate::trace::within(crate::trace::current(), work)).await {
        Ok(result) => Some(result),
        Err(join_error) if join_error.is_panic() => {
            std::panic::resume_unwind(join_error.into_panic())
        }
        Err(_) => None,
    }
}

/// What became of a response handed to [`complete`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Completion {
    /// Stored, or not stored for a reason already logged (the lease was lost,
    /// or the service did not answer: the lease then stays until it passes,
    /// since releasing would run the handler again).
    Settled,
    /// The service refused to store it (its own size limit is lower than
    /// ours, or the message is over its transport limit): the caller stores
    /// a terminal "not replayable" error instead.
    Refused,
}

/// Completes the key with `stored`.
pub(crate) async fn complete(lease: &mut Lease, stored: &StoredResponse) -> Completion {
    match lease.complete(stored).await {
        Ok(()) => Completion::Settled,
        Err(Error::LeaseLost) => {
            tracing::error!(
                key = %lease.id().key,
                "lease lost before the response was stored: the handler may have run twice"
            );
            Completion::Settled
        }
        Err(error) if error.is_refusal() => Completion::Refused,
        Err(error) => {
            tracing::warn!(%error, key = %lease.id().key, "response not stored");
            Completion::Settled
        }
    }
}

/// Releases the key, so a retry runs the handler again.
pub(crate) async fn release(lease: &mut Lease) {
    if let Err(error) = lease.release().await {
        tracing::warn!(%error, key = %lease.id().key, "could not release the key");
    }
}

/// Why the service refused Acquire (it was reachable).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// It refused this service's credentials, or its use of the namespace: a
    /// deployment's mistake, not an outage, so never run the handler
    /// unprotected, even failing open. Nothing ran and nothing was stored,
    /// so the end client may retry with the same key.
    NotAuthorized,
    /// The scope comes from the request (e.g. a subject too long): the
    /// client's fault, with the service's message.
    InvalidScope(String),
    /// Anything else: the idempotency service failed.
    Failed,
}

/// Classifies (and logs) the service's refusal of Acquire for `id`.
pub(crate) fn refusal(id: &RecordId, error: Error) -> Refusal {
    match error {
        error @ (Error::Unauthenticated { .. } | Error::PermissionDenied { .. }) => {
            tracing::error!(%error, namespace = %id.namespace,
                "the idempotency service refused this service: the request is not processed");
            Refusal::NotAuthorized
        }
        Error::InvalidArgument {
            field: Some(field),
            message,
        } if field.starts_with("id.") => Refusal::InvalidScope(message),
        error => {
            tracing::error!(%error, "idempotency service refused Acquire");
            Refusal::Failed
        }
    }
}
