"""Errors: why a call to the service failed (:class:`ServiceError` and its
subclasses, chosen by gRPC code and ``ErrorInfo`` reason, never by message
text), and why :meth:`Client.run` produced no response (:class:`RunError`)."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import grpc

from . import reason as _reason
from .models import StoredResponse

__all__ = [
    "IdempotencyError",
    "ServiceError",
    "InvalidArgument",
    "NotFound",
    "LeaseLost",
    "ResponseConflict",
    "NotInProgress",
    "Unauthenticated",
    "PermissionDenied",
    "Unavailable",
    "Internal",
    "UnexpectedStatus",
    "RunError",
    "RunInProgress",
    "RunPreviouslyFailed",
    "RunFingerprintMismatch",
    "RunLeaseLost",
    "RunNotStored",
]


class IdempotencyError(Exception):
    """Base of every error this package raises (but not of the business
    exceptions :meth:`Client.run` passes through)."""


class ServiceError(IdempotencyError):
    """A call to the idempotency service failed."""

    def __init__(
        self,
        message: str,
        *,
        code: Optional[grpc.StatusCode] = None,
        reason: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        #: The server's (or gRPC's) explanation.
        self.message = message
        #: The gRPC status code, when the service answered one.
        self.code = code
        #: The ``ErrorInfo`` reason (see :mod:`idempotency_client.reason`), when the answer carried one.
        self.reason = reason

    @property
    def is_unavailable(self) -> bool:
        """True when retrying later may succeed (the service or its database is down)."""
        return False

    @property
    def is_refusal(self) -> bool:
        """True when the service refused the request itself (malformed, or over
        a size limit): sending it again cannot succeed."""
        return False


class InvalidArgument(ServiceError):
    """A field of the request is malformed or out of range; nothing was written."""

    def __init__(self, message: str, *, field: Optional[str] = None, **kwargs) -> None:
        super().__init__(message, **kwargs)
        #: The field's path in the request (e.g. ``id.key``), when the server named one.
        self.field = field

    @property
    def is_refusal(self) -> bool:
        return True

    def __str__(self) -> str:
        field = f" {self.field}" if self.field else ""
        return f"invalid argument{field}: {self.message}"


class NotFound(ServiceError):
    """No live record has this id (never created, or expired)."""


class LeaseLost(ServiceError):
    """The fencing token is no longer the record's current one: another
    attempt took the key over after this lease ended (or the key was
    released), so the business logic may have run twice."""


class ResponseConflict(ServiceError):
    """The record is already completed or failed with another response."""


class NotInProgress(ServiceError):
    """The record is not in progress (finished, or released)."""


class Unauthenticated(ServiceError):
    """The service did not accept the caller's credential (none, expired,
    unknown), or this client had no token to send. Never retried."""


class PermissionDenied(ServiceError):
    """The service knows the caller but does not let it make this call; with
    reason ``NAMESPACE_FORBIDDEN`` the namespace is not one it may use."""


class Unavailable(ServiceError):
    """The service or its database could not be reached, even after retrying."""

    def __init__(self, message: str, *, attempts: int = 1, **kwargs) -> None:
        super().__init__(message, **kwargs)
        #: Calls made, the first included.
        self.attempts = attempts

    @property
    def is_unavailable(self) -> bool:
        return True

    def __str__(self) -> str:
        return f"idempotency service unavailable after {self.attempts} attempt(s): {self.message}"


class Internal(ServiceError):
    """The server failed unexpectedly; the cause is in its log."""


class UnexpectedStatus(ServiceError):
    """Any other status, kept whole (``code``, ``reason``, ``message``)."""

    @property
    def is_refusal(self) -> bool:
        # Over gRPC's message limit or the service's (MESSAGE_TOO_LARGE).
        return self.code == grpc.StatusCode.OUT_OF_RANGE


#: Codes worth retrying: every RPC of the service is idempotent, so a call
#: that may or may not have reached the server can be sent again.
TRANSIENT = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        # A connection reset mid-call surfaces as UNKNOWN.
        grpc.StatusCode.UNKNOWN,
    }
)


def from_status(
    code: grpc.StatusCode,
    message: str,
    trailing_metadata: Optional[Sequence[Tuple[str, object]]],
    attempts: int,
) -> ServiceError:
    """The typed error of a failed call, by code and ``ErrorInfo`` reason."""
    reason, fields = _details(trailing_metadata)
    kwargs = {"code": code, "reason": reason}
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(message, field=fields[0] if fields else None, **kwargs)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(message, **kwargs)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(message, **kwargs)
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return PermissionDenied(message, **kwargs)
    if code == grpc.StatusCode.ABORTED and reason == _reason.STALE_FENCING_TOKEN:
        return LeaseLost(message, **kwargs)
    if code == grpc.StatusCode.FAILED_PRECONDITION and reason == _reason.RESPONSE_CONFLICT:
        return ResponseConflict(message, **kwargs)
    if code == grpc.StatusCode.FAILED_PRECONDITION and reason == _reason.NOT_IN_PROGRESS:
        return NotInProgress(message, **kwargs)
    if code in TRANSIENT:
        return Unavailable(message, attempts=attempts, **kwargs)
    if code == grpc.StatusCode.INTERNAL:
        return Internal(message, **kwargs)
    return UnexpectedStatus(message, **kwargs)


def _details(metadata: Optional[Sequence[Tuple[str, object]]]) -> Tuple[Optional[str], List[str]]:
    """The ErrorInfo reason and the BadRequest fields of a status's details."""
    from google.rpc import error_details_pb2, status_pb2

    for key, value in metadata or ():
        if key != "grpc-status-details-bin" or not isinstance(value, bytes):
            continue
        status = status_pb2.Status()
        try:
            status.ParseFromString(value)
        except Exception:  # a proxy's garbage: no details
            return None, []
        reason: Optional[str] = None
        fields: List[str] = []
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason or reason
            elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                fields.extend(violation.field for violation in bad.field_violations)
        return reason, fields
    return None, []


class RunError(IdempotencyError):
    """Why :meth:`Client.run` produced no response (a business exception of
    the function is raised as itself, not as a RunError)."""


class RunInProgress(RunError):
    """Another attempt is running (HTTP 409 with ``Retry-After``)."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"another attempt is in progress; retry after {retry_after:.3f} s")
        #: When to retry, in seconds.
        self.retry_after = retry_after


class RunPreviouslyFailed(RunError):
    """An earlier attempt failed terminally: answer with its stored error."""

    def __init__(self, response: StoredResponse) -> None:
        super().__init__(f"an earlier attempt failed (status {response.status_code})")
        self.response = response


class RunFingerprintMismatch(RunError):
    """The key was used with a different request (HTTP 422)."""

    def __init__(self) -> None:
        super().__init__("the idempotency key was used with a different request")


class RunLeaseLost(RunError):
    """The function ran, but another attempt took the key over before its
    response was stored: the operation may have run twice."""

    def __init__(self, response: StoredResponse) -> None:
        super().__init__(
            "the lease was lost before the response was stored; the operation may have run twice"
        )
        #: What this attempt produced.
        self.response = response


class RunNotStored(RunError):
    """The function ran, but its response could not be stored. When the
    service refused the response itself (too large, a status out of range),
    a terminal failure (status 500) is stored in its place so that retries do
    not run the function again; otherwise (the service unreachable) the key
    stays in progress until its lease passes."""

    def __init__(self, response: StoredResponse, error: ServiceError) -> None:
        super().__init__(f"the operation ran but its response could not be stored: {error}")
        self.response = response
        self.error = error
