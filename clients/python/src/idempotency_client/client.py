"""The typed client: connection set-up, per-call timeouts, retries of
transient errors with exponential backoff and full jitter, a bearer token and
trace context on every call. Mirrors the Rust client (``client/src/client.rs``).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Optional, Sequence, Tuple, TypeVar, Union

import grpc

from . import errors
from ._tracing import CallTrace
from .errors import ServiceError, Unauthenticated, Unavailable
from .run import RunMixin
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
    Seconds,
    StoredResponse,
    seconds,
)

log = logging.getLogger("idempotency_client")

T = TypeVar("T")
#: A bearer token, or a function returning the current one (a rotated file).
Token = Union[str, Callable[[], Optional[str]]]


@dataclass(frozen=True)
class RetryPolicy:
    """How transient errors (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED,
    a reset connection) are retried; safe because every RPC of the service is
    idempotent. The Rust client's defaults."""

    #: Calls at most, the first included. 1 disables retries.
    max_attempts: int = 4
    #: Backoff ceiling before the second call, in seconds; doubles per attempt.
    initial_backoff: float = 0.025
    #: Largest backoff ceiling, in seconds.
    max_backoff: float = 1.0
    #: No new attempt starts after this many seconds since the first.
    max_elapsed: float = 5.0

    def backoff(self, retry: int) -> float:
        """"Full jitter": a uniform pick below the exponential ceiling, so that
        many callers failing together do not retry together."""
        ceiling = min(self.initial_backoff * (2 ** min(retry, 16)), self.max_backoff)
        return ceiling * random.random()


#: One call, no retries.
NO_RETRIES = RetryPolicy(max_attempts=1)


def _channel_target(target: str) -> Tuple[str, Optional[bool]]:
    """``host:port`` and whether the scheme asked for TLS (None: none given)."""
    for scheme, tls in (("http://", False), ("https://", True)):
        if target.startswith(scheme):
            return target[len(scheme) :].rstrip("/"), tls
    return target, None


class Client(RunMixin):
    """A handle to the idempotency service, safe to share between threads:
    :meth:`run` for the whole protocol in one call, or the RPCs one by one
    (:meth:`acquire`, :meth:`complete`, :meth:`fail`, :meth:`renew`, :meth:`get`).

    ``target`` is ``host:port`` (or ``http://host:port``; ``https://`` turns
    TLS on with the system's roots unless ``credentials`` are given).
    ``token`` is sent as ``authorization: Bearer <token>`` with every call: a
    string, or a function returning the current token (called per call; a
    call for which it returns nothing fails with :class:`Unauthenticated`
    without being sent). Send tokens over TLS only. ``timeout`` is the
    deadline of each call attempt in seconds (keep it above the server's
    worst case, 7 s by default); ``retry`` the retries of transient errors.
    ``channel_options`` are gRPC channel arguments; each replaces the
    client's own of the same name (no cap on answers, keepalive every 30 s,
    reconnection waits of 0.1 s growing to at most 1 s), and of a name given
    twice the last counts.
    """

    def __init__(
        self,
        target: str,
        *,
        token: Optional[Token] = None,
        credentials: Optional[grpc.ChannelCredentials] = None,
        timeout: Seconds = 10.0,
        retry: RetryPolicy = RetryPolicy(),
        channel_options: Sequence[Tuple[str, Any]] = (),
    ) -> None:
        from ._pb.idempotency.v1 import idempotency_pb2_grpc

        address, tls = _channel_target(target)
        if tls and credentials is None:
            credentials = grpc.ssl_channel_credentials()
        # gRPC takes the first of two options of one name: the caller's
        # replace these defaults rather than follow them.
        options = {
            # Stored responses may be large: no 4 MiB cap on answers.
            "grpc.max_receive_message_length": -1,
            "grpc.keepalive_time_ms": 30_000,
            # grpcio waits longer after each failed reconnection (1 s, x1.6,
            # up to 120 s) and fails calls at once while it waits: after a
            # long outage the client would not see the service back for up
            # to two minutes. Capped, it tries again within a second.
            "grpc.initial_reconnect_backoff_ms": 100,
            "grpc.max_reconnect_backoff_ms": 1_000,
        }
        options.update(channel_options)
        arguments = list(options.items())
        if credentials is not None:
            self._channel = grpc.secure_channel(address, credentials, options=arguments)
        else:
            self._channel = grpc.insecure_channel(address, options=arguments)
        self._stub = idempotency_pb2_grpc.IdempotencyServiceStub(self._channel)
        self._token = token
        self.timeout = seconds(timeout)
        self.retry = retry

    # -- lifecycle -----------------------------------------------------------

    def close(self) -> None:
        """Closes the connection; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the RPCs --------------------------------------------------------------

    def acquire(self, request: AcquireRequest) -> Acquisition:
        """Reserves a key, or tells why not to run the business logic now."""
        from ._pb.idempotency.v1 import idempotency_pb2 as pb

        message = pb.AcquireRequest(id=_id_to_pb(request.id), fingerprint=request.fingerprint)
        if request.ttl is not None:
            message.ttl.CopyFrom(_duration(request.ttl))
        if request.lease is not None:
            message.lease.CopyFrom(_duration(request.lease))
        answer = self._call("Acquire", self._stub.Acquire, message)
        outcome = answer.WhichOneof("outcome")
        if outcome == "acquired":
            acquired = answer.acquired
            return Acquired(
                id=request.id,
                fencing_token=acquired.fencing_token,
                lease_expires_at=_time(acquired.lease_expires_at),
                expires_at=_time(acquired.expires_at),
            )
        if outcome == "in_progress":
            in_progress = answer.in_progress
            return InProgress(
                retry_after=in_progress.retry_after.ToTimedelta().total_seconds(),
                lease_expires_at=_optional_time(in_progress, "lease_expires_at"),
            )
        if outcome == "completed":
            return Completed(
                response=_response(answer.completed.response),
                completed_at=_optional_time(answer.completed, "completed_at"),
            )
        if outcome == "failed":
            return Failed(
                error_response=_response(answer.failed.error_response),
                failed_at=_optional_time(answer.failed, "failed_at"),
            )
        if outcome == "fingerprint_mismatch":
            return FingerprintMismatch()
        raise errors.Internal("Acquire answered no outcome")

    def complete(self, id: RecordId, fencing_token: int, response: StoredResponse) -> datetime:
        """Stores the response of the attempt holding ``fencing_token``; later
        Acquires replay it. Returns when the record completed. Raises
        :class:`LeaseLost` when another attempt took the key over."""
        from ._pb.idempotency.v1 import idempotency_pb2 as pb

        message = pb.CompleteRequest(
            id=_id_to_pb(id), fencing_token=fencing_token, response=_response_to_pb(response)
        )
        return _time(self._call("Complete", self._stub.Complete, message).completed_at)

    def fail(
        self,
        id: RecordId,
        fencing_token: int,
        *,
        retryable: bool,
        error_response: Optional[StoredResponse] = None,
    ) -> RecordState:
        """Ends the attempt without success: ``retryable=True`` releases the key
        for the next Acquire; ``retryable=False`` stores ``error_response`` for
        later Acquires to replay. Returns the record's state (RELEASED or FAILED)."""
        from ._pb.idempotency.v1 import idempotency_pb2 as pb

        message = pb.FailRequest(id=_id_to_pb(id), fencing_token=fencing_token, retryable=retryable)
        if error_response is not None:
            message.error_response.CopyFrom(_response_to_pb(error_response))
        return RecordState(self._call("Fail", self._stub.Fail, message).state)

    def renew(self, id: RecordId, fencing_token: int, lease: Optional[Seconds] = None) -> Renewed:
        """Extends the lease of the attempt holding ``fencing_token`` to
        ``lease`` from now (``None``: the server's default)."""
        from ._pb.idempotency.v1 import idempotency_pb2 as pb

        message = pb.RenewRequest(id=_id_to_pb(id), fencing_token=fencing_token)
        if lease is not None:
            message.lease.CopyFrom(_duration(lease))
        renewed = self._call("Renew", self._stub.Renew, message)
        return Renewed(
            lease_expires_at=_time(renewed.lease_expires_at), expires_at=_time(renewed.expires_at)
        )

    def get(self, id: RecordId) -> Optional[Record]:
        """Reads a record; ``None`` when no live record has this id."""
        from ._pb.idempotency.v1 import idempotency_pb2 as pb

        try:
            answer = self._call("Get", self._stub.Get, pb.GetRequest(id=_id_to_pb(id)))
        except errors.NotFound:
            return None
        record = answer.record
        try:
            state = RecordState(record.state)
        except ValueError:
            raise errors.Internal(f"unknown record state {record.state}") from None
        return Record(
            id=id,
            state=state,
            fingerprint=record.fingerprint,
            fencing_token=record.fencing_token,
            created_at=_time(record.created_at),
            expires_at=_time(record.expires_at),
            lease_expires_at=_optional_time(record, "lease_expires_at"),
            completed_at=_optional_time(record, "completed_at"),
            response=_response(record.response) if record.HasField("response") else None,
        )

    # -- calls -----------------------------------------------------------------

    def _metadata(self, trace: CallTrace) -> list:
        metadata = trace.metadata()
        if self._token is not None:
            token = self._token() if callable(self._token) else self._token
            if not token:
                raise Unauthenticated("no bearer token to send: the token source returned none")
            metadata.append(("authorization", f"Bearer {token}"))
        return metadata

    def _call(self, rpc: str, method: Callable[..., T], message: Any) -> T:
        """One unary call with the per-attempt deadline, retrying transient errors."""
        policy = self.retry
        trace = CallTrace()
        started = time.monotonic()
        attempts = 0
        while True:
            attempts += 1
            metadata = self._metadata(trace)
            log.debug("idempotency %s attempt %d trace_id=%s", rpc, attempts, trace.trace_id)
            try:
                return method(message, timeout=self.timeout, metadata=metadata)
            except grpc.RpcError as error:
                code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
                details = (error.details() if hasattr(error, "details") else None) or str(code)
                trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
            pause = policy.backoff(attempts - 1)
            may_retry = (
                code in errors.TRANSIENT
                and attempts < policy.max_attempts
                and time.monotonic() - started + pause < policy.max_elapsed
            )
            if not may_retry:
                failure: ServiceError = errors.from_status(code, details, trailing, attempts)
                log.debug(
                    "idempotency %s failed: %s (trace_id=%s)", rpc, failure, trace.trace_id
                )
                raise failure
            log.debug(
                "retrying the idempotency service: %s after %s, attempt %d, pause %.3f s",
                rpc, code.name, attempts, pause,
            )
            time.sleep(pause)


def _id_to_pb(id: RecordId) -> Any:
    from ._pb.idempotency.v1 import idempotency_pb2 as pb

    return pb.RecordId(namespace=id.namespace, operation=id.operation, subject=id.subject, key=id.key)


def _response_to_pb(response: StoredResponse) -> Any:
    from ._pb.idempotency.v1 import idempotency_pb2 as pb

    return pb.StoredResponse(
        status_code=response.status_code, body=response.body, headers=dict(response.headers)
    )


def _response(message: Any) -> StoredResponse:
    return StoredResponse(
        status_code=message.status_code, body=bytes(message.body), headers=dict(message.headers)
    )


def _duration(value: Seconds) -> Any:
    from google.protobuf import duration_pb2

    duration = duration_pb2.Duration()
    duration.FromTimedelta(timedelta(seconds=seconds(value)))
    return duration


def _time(timestamp: Any) -> datetime:
    return datetime.fromtimestamp(
        timestamp.seconds + timestamp.nanos / 1e9, tz=timezone.utc
    )


def _optional_time(message: Any, field: str) -> Optional[datetime]:
    return _time(getattr(message, field)) if message.HasField(field) else None


__all__ = ["Client", "RetryPolicy", "NO_RETRIES", "Token", "Unavailable"]
