"""Python client of the idempotency service: make an operation run once per
idempotency key with one call (:meth:`Client.run`), or drive the protocol
yourself (:meth:`Client.acquire`, ``complete``, ``fail``, ``renew``, ``get``).

- :class:`Client`: typed calls with per-call timeouts, retries of transient
  errors (backoff with jitter), a bearer token and W3C trace context;
- :meth:`Client.run` with :class:`RunOptions`: acquire, run once, store, replay;
  lease keep-alive in a background thread; fail open or closed;
- :mod:`idempotency_client.fingerprint`: RFC 8785 canonical JSON and SHA-256,
  the same digests as the Rust client's;
- :mod:`idempotency_client.errors`: typed errors carrying the ErrorInfo reason.
"""

from . import fingerprint, reason
from .client import NO_RETRIES, Client, RetryPolicy, Token
from .errors import (
    IdempotencyError,
    Internal,
    InvalidArgument,
    LeaseLost,
    NotFound,
    NotInProgress,
    PermissionDenied,
    ResponseConflict,
    RunError,
    RunFingerprintMismatch,
    RunInProgress,
    RunLeaseLost,
    RunNotStored,
    RunPreviouslyFailed,
    ServiceError,
    Unauthenticated,
    Unavailable,
    UnexpectedStatus,
)
from .models import (
    Acquired,
    AcquireRequest,
    Acquisition,
    Completed,
    Failed,
    FingerprintMismatch,
    InProgress,
    Record,
    RecordId,
    RecordState,
    Renewed,
    StoredResponse,
)
from .run import (
    RETRYABLE,
    UNSTORABLE_RESPONSE,
    Attempt,
    Failure,
    Lease,
    OnUnavailable,
    Outcome,
    Ran,
    Retryable,
    RunOptions,
    Terminal,
)

__all__ = [
    "Acquired", "AcquireRequest", "Acquisition", "Attempt", "Client", "Completed", "Failed",
    "Failure", "FingerprintMismatch", "IdempotencyError", "InProgress", "Internal",
    "InvalidArgument", "Lease", "LeaseLost", "NO_RETRIES", "NotFound", "NotInProgress",
    "OnUnavailable", "Outcome", "PermissionDenied", "RETRYABLE", "Ran", "Record", "RecordId",
    "RecordState", "Renewed", "ResponseConflict", "RetryPolicy", "Retryable", "RunError",
    "RunFingerprintMismatch", "RunInProgress", "RunLeaseLost", "RunNotStored", "RunOptions",
    "RunPreviouslyFailed", "ServiceError", "StoredResponse", "Terminal", "Token",
    "UNSTORABLE_RESPONSE", "Unauthenticated", "Unavailable", "UnexpectedStatus", "fingerprint",
    "reason",
]
