"""The one-call API, as the Rust client's ``Client::run``: acquire, run the
business logic once, store its outcome, and answer duplicates with the stored
response; with a lease kept alive in a background thread while it runs."""

from __future__ import annotations

import enum
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Callable, Optional, Union, cast

from . import errors
from .errors import (
    LeaseLost,
    RunFingerprintMismatch,
    RunInProgress,
    RunLeaseLost,
    RunNotStored,
    RunPreviouslyFailed,
    ServiceError,
)
from .models import (
    Acquired,
    AcquireRequest,
    Acquisition,
    Completed,
    Failed,
    FingerprintMismatch,
    InProgress,
    RecordId,
    Seconds,
    StoredResponse,
    seconds,
)

if TYPE_CHECKING:
    from .client import Client

log = logging.getLogger("idempotency_client")

#: Longest a lease is kept alive, in seconds: a hung operation cannot hold its key forever.
MAX_KEEP_ALIVE = 3600.0

#: The body of the terminal failure stored when the service refuses a
#: response that run()'s function produced (see :class:`RunNotStored`).
UNSTORABLE_RESPONSE = "the operation ran, but the idempotency service refused to store its response"


@dataclass(frozen=True)
class Retryable:
    """Transient (a timeout downstream, a 5xx): release the key so a retry runs again."""


@dataclass(frozen=True)
class Terminal:
    """Final (card declined, validation): store this response; retries get it back."""

    response: StoredResponse


#: What to do with a business exception: give the key back, or store an error for replay.
Failure = Union[Retryable, Terminal]
RETRYABLE = Retryable()


class OnUnavailable(enum.Enum):
    """What :meth:`Client.run` does when the service cannot be reached."""

    #: Refuse: the service's :class:`Unavailable` error is raised (map it to 503). The default.
    FAIL_CLOSED = "fail_closed"
    #: Run the function without idempotency (logged as a warning), for
    #: operations where a rare duplicate is harmless. Only when the service is
    #: unreachable: Unauthenticated or PermissionDenied are raised whatever this policy.
    FAIL_OPEN = "fail_open"


def _always_retryable(_: BaseException) -> Failure:
    return RETRYABLE


@dataclass(frozen=True)
class RunOptions:
    """How :meth:`Client.run` behaves. The defaults: fail closed, answer "in
    progress" at once, no background renewal, every exception releases the key."""

    #: Per business exception: release the key (``RETRYABLE``) or store an error (``Terminal``).
    classify: Callable[[BaseException], Failure] = _always_retryable
    #: Fail open or closed when the service cannot be reached.
    on_unavailable: OnUnavailable = OnUnavailable.FAIL_CLOSED
    #: While another attempt is in progress, wait (honouring its retry_after)
    #: up to this many seconds for its outcome instead of raising at once.
    wait_in_progress: Optional[Seconds] = None
    #: Renew the lease to this many seconds while the function runs.
    keep_alive: Optional[Seconds] = None
    #: How often to renew; ``None`` or more than a third of ``keep_alive``: a third.
    keep_alive_every: Optional[Seconds] = None


class Outcome(enum.Enum):
    """How :meth:`Client.run` obtained its response."""

    #: The function ran now and its response is stored.
    EXECUTED = "executed"
    #: An earlier attempt's stored response; the function did not run.
    REPLAYED = "replayed"
    #: The service was unreachable and the options fail open: the function ran unprotected.
    UNPROTECTED = "unprotected"


@dataclass(frozen=True)
class Ran:
    """A successful answer of :meth:`Client.run`."""

    outcome: Outcome
    response: StoredResponse

    @property
    def replayed(self) -> bool:
        """True when the response is an earlier attempt's (send ``Idempotent-Replayed: true``)."""
        return self.outcome is Outcome.REPLAYED


@dataclass
class Attempt:
    """What the function is told about its attempt."""

    #: The fencing token to pass to storage that checks it; ``None`` when
    #: running without idempotency (fail open).
    fencing_token: Optional[int]
    #: Set when background renewal learns the lease was taken over: stop, the
    #: response will not be stored.
    lease_lost: threading.Event = field(default_factory=threading.Event)


class Lease:
    """The right to run the business logic for one key, with an optional
    keep-alive thread. Used by :meth:`Client.run`; usable on its own."""

    def __init__(self, client: "Client", acquired: Acquired) -> None:
        self.client = client
        self.id: RecordId = acquired.id
        self.fencing_token = acquired.fencing_token
        self.lease_expires_at = acquired.lease_expires_at
        #: Set once the lease is known lost (renewal refused, or it passed).
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def keep_alive(self, lease: Seconds, every: Optional[Seconds] = None) -> None:
        """Renews the lease to ``lease`` every ``every`` seconds (at most a
        third of ``lease``, so one or two missed renewals do not lose it) in a
        daemon thread until :meth:`stop`, for at most an hour. The first
        renewal comes within a third of what is left of the lease held now.
        Renewal stops and :attr:`lost` is set when the service answers that
        the lease is gone or refuses the renewal outright, or when renewals
        kept failing until the lease passed; other errors are retried at the
        next tick."""
        self.stop()
        self._stop = threading.Event()
        lease_s = seconds(lease)
        third = lease_s / 3
        period = third if not every else min(seconds(every), third)
        period = max(period, 0.01)
        held = max(0.0, (self.lease_expires_at - datetime.now(timezone.utc)).total_seconds())
        thread = threading.Thread(
            target=self._renew_loop,
            args=(lease_s, period, min(period, held / 3), held, self._stop),
            name=f"idempotency-keep-alive-{self.id.key}",
            daemon=True,
        )
        self._thread = thread
        thread.start()

    def stop(self) -> None:
        """Stops renewing; a renewal in flight is ignored."""
        self._stop.set()

    def _renew_loop(
        self, lease: float, every: float, first: float, held: float, stop: threading.Event
    ) -> None:
        started = time.monotonic()
        # When the lease ends by this machine's monotonic clock: from the
        # clock skew only until the first renewal, then from the time each
        # successful renewal was sent.
        held_until = started + held
        tick = started + first
        while not stop.wait(max(0.0, tick - time.monotonic())):
            now = time.monotonic()
            tick = max(tick + every, now)  # a late tick delays the next, as tokio's Delay
            if now - started > MAX_KEEP_ALIVE:
                log.warning("stopped renewing a lease held longer than %.0f s (key %s)", MAX_KEEP_ALIVE, self.id.key)
                return
            try:
                self.client.renew(self.id, self.fencing_token, lease)
                held_until = now + lease
                continue
            except ServiceError as error:
                failure = error
            if stop.is_set():
                return
            if _renewal_cannot_succeed(failure):
                log.warning("lease lost while renewing (key %s): %s", self.id.key, failure)
                self.lost.set()
                return
            if time.monotonic() >= held_until:
                # Past the lease (this machine's clock), another attempt may
                # hold the key: the function must hear of it.
                log.warning("lease passed while renewals failed (key %s): %s", self.id.key, failure)
                self.lost.set()
                return
            log.debug("renewal failed; retrying at the next tick: %s", failure)


def _renewal_cannot_succeed(error: ServiceError) -> bool:
    """Whether a renewal's error means the lease is gone for good: another
    attempt holds the key, the record is finished or gone, or the request is
    refused. Anything else (unreachable, one internal error) may pass."""
    return isinstance(
        error,
        (LeaseLost, errors.NotInProgress, errors.NotFound, errors.ResponseConflict, errors.InvalidArgument),
    )


class RunMixin:
    """:meth:`run` and :meth:`acquire_waiting`, mixed into :class:`Client`."""

    def acquire_waiting(self, request: AcquireRequest, wait: Optional[Seconds] = None) -> Acquisition:
        """Acquires; while another attempt is in progress and ``wait`` (seconds)
        allows, sleeps for its ``retry_after`` (with jitter) and asks again."""
        client = cast("Client", self)
        deadline = None if wait is None else time.monotonic() + seconds(wait)
        while True:
            acquisition = client.acquire(request)
            if not isinstance(acquisition, InProgress):
                return acquisition
            # Jitter of +-20 % keeps waiting duplicates from arriving together.
            pause = max(acquisition.retry_after, 0.01) * (0.8 + 0.4 * random.random())
            if deadline is None or time.monotonic() + pause >= deadline:
                return acquisition
            time.sleep(pause)

    def run(
        self,
        request: AcquireRequest,
        fn: Callable[[Attempt], StoredResponse],
        options: Optional[RunOptions] = None,
    ) -> Ran:
        """Runs ``fn`` at most once per key: acquires, calls ``fn(attempt)``,
        stores the :class:`StoredResponse` it returns, and answers a duplicate
        with the stored response without calling ``fn``.

        An exception raised by ``fn`` is classified by ``options.classify``:
        the key is released (the default) or the error response stored, and
        the exception is raised again as itself. A ``BaseException``
        (``KeyboardInterrupt``, ``SystemExit``) always releases the key. Once
        ``fn`` returned, the key is never released: its effects happened.

        Raises :class:`RunInProgress`, :class:`RunPreviouslyFailed`,
        :class:`RunFingerprintMismatch`, :class:`RunLeaseLost`,
        :class:`RunNotStored`, or the :class:`ServiceError` of a service that
        refused or could not be reached (fail closed).
        """
        client = cast("Client", self)
        options = options or RunOptions()
        try:
            acquisition = self.acquire_waiting(request, options.wait_in_progress)
        except errors.Unavailable as error:
            if options.on_unavailable is not OnUnavailable.FAIL_OPEN:
                raise
            log.warning(
                "idempotency service unavailable: running without idempotency (fail open); "
                "namespace=%s operation=%s: %s",
                request.id.namespace, request.id.operation, error,
            )
            return Ran(Outcome.UNPROTECTED, _checked(fn(Attempt(fencing_token=None))))
        acquired = _acquired_or_answer(acquisition)
        if isinstance(acquired, Ran):
            return acquired
        lease = Lease(client, acquired)
        if options.keep_alive is not None:
            lease.keep_alive(options.keep_alive, options.keep_alive_every)
        attempt = Attempt(fencing_token=lease.fencing_token, lease_lost=lease.lost)
        try:
            response = fn(attempt)
        except Exception as business:
            lease.stop()
            _store_failure(client, lease, options, business)
            raise
        except BaseException:
            lease.stop()
            _release(client, lease, "an interrupted attempt")
            raise
        lease.stop()
        if not isinstance(response, StoredResponse):
            error = TypeError(f"run()'s function must return a StoredResponse, not {type(response).__name__}")
            _fail_unstorable(client, lease, error)
            raise error
        return _store_response(client, lease, response)


def _checked(response: object) -> StoredResponse:
    if not isinstance(response, StoredResponse):
        raise TypeError(f"run()'s function must return a StoredResponse, not {type(response).__name__}")
    return response


def _acquired_or_answer(acquisition: Acquisition) -> Union[Acquired, Ran]:
    """The lease to run the function with, or the answer to give without running it."""
    if isinstance(acquisition, Acquired):
        return acquisition
    if isinstance(acquisition, Completed):
        return Ran(Outcome.REPLAYED, acquisition.response)
    if isinstance(acquisition, InProgress):
        raise RunInProgress(acquisition.retry_after)
    if isinstance(acquisition, Failed):
        raise RunPreviouslyFailed(acquisition.error_response)
    if isinstance(acquisition, FingerprintMismatch):
        raise RunFingerprintMismatch()
    raise errors.Internal(f"unknown acquisition {acquisition!r}")


def _store_response(client: "Client", lease: Lease, response: StoredResponse) -> Ran:
    try:
        client.complete(lease.id, lease.fencing_token, response)
    except LeaseLost:
        lease.lost.set()
        raise RunLeaseLost(response) from None
    except ServiceError as error:
        if error.is_refusal:
            _fail_unstorable(client, lease, error)
        raise RunNotStored(response, error) from error
    return Ran(Outcome.EXECUTED, response)


def _store_failure(client: "Client", lease: Lease, options: RunOptions, business: Exception) -> None:
    """Releases the key, or stores the business error for replay, as classified."""
    try:
        failure = options.classify(business)
    except Exception:
        log.exception("run()'s classify raised; releasing the key")
        failure = RETRYABLE
    if isinstance(failure, Terminal):
        try:
            client.fail(lease.id, lease.fencing_token, retryable=False, error_response=failure.response)
        except ServiceError as error:
            log.warning("could not record the failure (key %s): %s", lease.id.key, error)
    else:
        _release(client, lease, "a retryable failure")


def _release(client: "Client", lease: Lease, what: str) -> None:
    try:
        client.fail(lease.id, lease.fencing_token, retryable=True)
    except ServiceError as error:
        log.warning("could not release the key after %s (key %s): %s", what, lease.id.key, error)


def _fail_unstorable(client: "Client", lease: Lease, refusal: Exception) -> None:
    """Stores a terminal failure in place of a response the service refused,
    so that a retry after the lease passes does not run the function again."""
    log.error(
        "the service refused the response (key %s): storing a failure so retries do not run again: %s",
        lease.id.key, refusal,
    )
    try:
        client.fail(
            lease.id, lease.fencing_token, retryable=False,
            error_response=StoredResponse(500, UNSTORABLE_RESPONSE.encode()),
        )
    except ServiceError as error:
        log.warning("could not store the failure either (key %s): %s", lease.id.key, error)
