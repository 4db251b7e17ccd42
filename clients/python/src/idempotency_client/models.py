"""Domain types of the client, free of protobuf: what you send and what the
service answers. Durations are seconds (``float``) or ``timedelta``; times
are timezone-aware ``datetime`` in UTC."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Dict, Optional, Union

#: A duration: seconds, or a ``timedelta``.
Seconds = Union[float, int, timedelta]


def seconds(value: Seconds) -> float:
    """``value`` in seconds."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    return float(value)


@dataclass(frozen=True)
class RecordId:
    """The scope of an idempotency key: a record is unique per (namespace,
    operation, subject, key), so one caller never reads another's."""

    #: The calling service, ``[a-z0-9][a-z0-9._-]*``, 1-63 characters.
    namespace: str
    #: The route or operation the key guards, e.g. ``POST /payments``.
    operation: str
    #: The end client's idempotency key, 8-128 printable ASCII characters without space.
    key: str
    #: On whose behalf (user, account, tenant); may be empty.
    subject: str = ""


@dataclass
class StoredResponse:
    """A response stored by Complete or a terminal Fail, replayed byte for byte."""

    #: Status code of the original answer (an HTTP status, say); 0 when none.
    status_code: int = 0
    #: Body of the original answer; a ``str`` is stored as UTF-8.
    body: bytes = b""
    #: Headers or metadata of the original answer.
    headers: Dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.body, str):
            self.body = self.body.encode("utf-8")
        elif not isinstance(self.body, bytes):
            self.body = bytes(self.body)


@dataclass(frozen=True)
class AcquireRequest:
    """What to reserve."""

    #: The record.
    id: RecordId
    #: Hash of the canonical request (see :mod:`idempotency_client.fingerprint`); empty: do not check.
    fingerprint: bytes = b""
    #: Record lifetime; ``None``: the server's default (24 h).
    ttl: Optional[Seconds] = None
    #: Lease of this attempt; ``None``: the server's default (60 s).
    lease: Optional[Seconds] = None


class RecordState(enum.Enum):
    """The life of a record."""

    #: An attempt holds, or held, a lease and has not finished.
    IN_PROGRESS = 1
    #: The attempt completed; its response is stored.
    COMPLETED = 2
    #: The attempt failed terminally; its error response is stored.
    FAILED = 3
    #: The attempt failed retryably and released the key.
    RELEASED = 4


@dataclass(frozen=True)
class Acquired:
    """You hold the key: run the business logic, then ``complete`` or ``fail``."""

    #: The record acquired.
    id: RecordId
    #: This attempt's token; later attempts on the key get larger ones. Pass
    #: it to storage that checks fencing tokens.
    fencing_token: int
    #: When the lease ends and another attempt may take the key over.
    lease_expires_at: datetime
    #: When the record expires.
    expires_at: datetime


@dataclass(frozen=True)
class InProgress:
    """Another attempt holds a live lease: answer "in progress, retry later"."""

    #: When to retry, in seconds (the remaining lease, at most a second).
    retry_after: float
    #: When the other attempt's lease ends, unless renewed.
    lease_expires_at: Optional[datetime]


@dataclass(frozen=True)
class Completed:
    """A previous attempt completed: answer with its stored response."""

    response: StoredResponse
    completed_at: Optional[datetime]


@dataclass(frozen=True)
class Failed:
    """A previous attempt failed terminally: answer with its stored error."""

    error_response: StoredResponse
    failed_at: Optional[datetime]


@dataclass(frozen=True)
class FingerprintMismatch:
    """The key was first used with another request: a client bug (HTTP 422)."""


#: What Acquire answered: exactly one of these.
Acquisition = Union[Acquired, InProgress, Completed, Failed, FingerprintMismatch]


@dataclass(frozen=True)
class Renewed:
    """The lease was extended."""

    lease_expires_at: datetime
    expires_at: datetime


@dataclass(frozen=True)
class Record:
    """A record as :meth:`Client.get` reads it."""

    id: RecordId
    state: RecordState
    #: The fingerprint the record was created with (empty when none).
    fingerprint: bytes
    #: The current fencing token.
    fencing_token: int
    created_at: datetime
    expires_at: datetime
    #: When the current lease ends (in progress only).
    lease_expires_at: Optional[datetime]
    #: When it completed or failed.
    completed_at: Optional[datetime]
    #: The stored response (completed) or error response (failed).
    response: Optional[StoredResponse]
