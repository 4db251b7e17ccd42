"""The HTTP ``Idempotency-Key`` contract as ASGI middleware (FastAPI,
Starlette, any ASGI app), the same contract as the Rust HTTP layer
(``client/src/http/mod.rs``). For the methods it covers (POST and PATCH by
default):

====================================================  ===============================================
Request                                               Answer
====================================================  ===============================================
no ``Idempotency-Key``                                passed through, or ``400`` with ``require_key``
malformed key                                         ``400`` (``application/problem+json``)
body over ``max_body_bytes``                          ``413``
first request                                         the app runs; its response is stored (2xx and
                                                      4xx but 408, 409, 425, 429: ``store_when``) or
                                                      the key released (those and 5xx, or an exception);
                                                      too large to store: a stored 500
duplicate while the first runs                        ``409`` with ``Retry-After``
duplicate after it finished                           the stored status, allow-listed headers and
                                                      body, with ``Idempotent-Replayed: true``
same key, another body                                ``422``
idempotency service unreachable                       ``503`` (fail closed) or the app unprotected
service refuses this service's credentials            ``500``, the app not run, even failing open
====================================================  ===============================================

The scope of a key: namespace = the ``namespace`` given, operation = method
and path (or ``scope["route"].path`` when something outside set a route
template there), subject = ``subject(scope)`` (e.g. the authenticated user). The
fingerprint covers the path with its query and the body (canonical JSON for
JSON bodies, without the ``exclude`` pointers; else its bytes), as the Rust
layer computes it. The app's response is buffered, stored, then sent.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import math
from typing import Any, Awaitable, Callable, Dict, Iterable, List, MutableMapping, Optional, Sequence, Tuple

from . import errors, fingerprint
from .client import Client
from .models import Acquired, AcquireRequest, Completed, Failed, FingerprintMismatch, InProgress, RecordId, Seconds, StoredResponse
from .run import Lease, OnUnavailable

log = logging.getLogger("idempotency_client")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Response headers stored and replayed by default.
REPLAY_HEADERS = ("content-type", "content-encoding", "content-language", "location", "etag",
                  "last-modified", "cache-control")


def stores_by_default(status: int) -> bool:
    """2xx, and 4xx except 408, 409, 425 and 429: those say "not now" (the
    request did not run or was refused before it ran), so storing one would
    answer every retry under the key with it until the key expires."""
    return 200 <= status < 300 or (400 <= status < 500 and status not in (408, 409, 425, 429))


class IdempotencyMiddleware:
    """Wraps an ASGI ``app``; ``client`` is a :class:`Client` shared by the process."""

    def __init__(
        self,
        app: ASGIApp,
        client: Client,
        namespace: str,
        *,
        methods: Iterable[str] = ("POST", "PATCH"),
        require_key: bool = False,
        subject: Optional[Callable[[Scope], Optional[str]]] = None,
        exclude: Sequence[str] = (),
        max_body_bytes: int = 1024 * 1024,
        max_stored_bytes: int = 1024 * 1024,
        store_when: Callable[[int], bool] = stores_by_default,
        replay_headers: Iterable[str] = REPLAY_HEADERS,
        on_unavailable: OnUnavailable = OnUnavailable.FAIL_CLOSED,
        ttl: Optional[Seconds] = None,
        lease: Seconds = 60,
        renew_every: Optional[Seconds] = 20,
        problem_type_base: str = "urn:idempotency:problem:",
    ) -> None:
        for pointer in exclude:
            if pointer and not pointer.startswith("/"):
                raise ValueError(f"{pointer!r} is not a JSON Pointer (it must be empty or start with '/')")
        self.app, self.client, self.namespace = app, client, namespace
        self.methods = {method.upper() for method in methods}
        self.require_key, self.subject, self.exclude = require_key, subject, list(exclude)
        self.max_body_bytes, self.store_when, self.on_unavailable = max_body_bytes, store_when, on_unavailable
        self.max_stored_bytes = max_stored_bytes
        self.replay_headers = {name.lower() for name in replay_headers}
        self.ttl, self.lease, self.renew_every = ttl, lease, renew_every
        self.problem_type_base = problem_type_base

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"].upper() not in self.methods:
            return await self.app(scope, receive, send)
        keys = [v for k, v in scope.get("headers", []) if k.lower() == b"idempotency-key"]
        if not keys:
            if not self.require_key:
                return await self.app(scope, receive, send)
            return await self._problem(send, 400, "missing-idempotency-key",
                                       "this operation requires an Idempotency-Key header")
        key, why = _read_key(keys)
        if key is None:
            return await self._problem(send, 400, "malformed-idempotency-key", why)
        body = await _read_body(receive, self.max_body_bytes)
        if body is None:
            return await self._problem(send, 413, "request-too-large",
                                       f"the request body is larger than {self.max_body_bytes} bytes")
        request = AcquireRequest(
            RecordId(self.namespace, _operation(scope), key, (self.subject(scope) if self.subject else None) or ""),
            _request_fingerprint(scope, body, self.exclude), ttl=self.ttl, lease=self.lease,
        )
        try:
            outcome = await _in_thread(self.client.acquire, request)
        except errors.Unavailable as error:
            if self.on_unavailable is OnUnavailable.FAIL_OPEN:
                log.warning("idempotency service unavailable: running without idempotency (fail open): %s", error)
                return await self.app(scope, _replay_body(body), send)
            log.warning("idempotency service unavailable: answering 503: %s", error)
            return await self._problem(send, 503, "idempotency-unavailable",
                                       "the idempotency service is unavailable; retry later")
        except (errors.Unauthenticated, errors.PermissionDenied) as error:
            log.error("the idempotency service refused this service: answering 500: %s", error)
            return await self._problem(send, 500, "idempotency-not-authorized",
                                       "this service may not use the idempotency service")
        except errors.InvalidArgument as error:
            if error.field and error.field.startswith("id."):
                return await self._problem(send, 400, "invalid-idempotency-scope", error.message)
            raise
        if isinstance(outcome, InProgress):
            return await self._problem(send, 409, "request-in-progress",
                                       "a request with this Idempotency-Key is in progress; retry later",
                                       [(b"retry-after", str(max(1, math.ceil(outcome.retry_after))).encode())])
        if isinstance(outcome, (Completed, Failed)):
            stored = outcome.response if isinstance(outcome, Completed) else outcome.error_response
            return await _send_stored(send, stored)
        if isinstance(outcome, FingerprintMismatch):
            return await self._problem(send, 422, "idempotency-key-reused",
                                       "this Idempotency-Key was already used with a different request")
        await self._execute(scope, body, outcome, send)

    async def _execute(self, scope: Scope, body: bytes, acquired: Acquired, send: Send) -> None:
        lease = Lease(self.client, acquired)
        if self.renew_every is not None:
            lease.keep_alive(self.lease, self.renew_every)
        captured: List[Message] = []

        async def capture(message: Message) -> None:
            captured.append(message)

        try:
            await self.app(scope, _replay_body(body), capture)
        except BaseException:
            lease.stop()
            await _in_thread(_release, self.client, lease)
            raise
        lease.stop()
        start = next((m for m in captured if m["type"] == "http.response.start"), None)
        content = b"".join(m.get("body", b"") for m in captured if m["type"] == "http.response.body")
        status = start["status"] if start else 500
        headers = list(start.get("headers", [])) if start else []
        if self.store_when(status):
            await _in_thread(self._store, lease, StoredResponse(status, content, _replayable(headers, self.replay_headers)))
        else:
            await _in_thread(_release, self.client, lease)
        for message in captured:
            await send(message)

    def _store(self, lease: Lease, stored: StoredResponse) -> None:
        """Stores the app's response; one too large to store is replaced by a
        terminal 500, since running the app again could repeat its effects.
        Any other failure leaves the key in progress until its lease passes."""
        size = len(stored.body) + sum(len(k) + len(v) for k, v in stored.headers.items())
        if size <= self.max_stored_bytes:
            try:
                self.client.complete(lease.id, lease.fencing_token, stored)
                return
            except errors.LeaseLost:
                log.error("lease lost before the response was stored (key %s): the app may have run twice",
                          lease.id.key)
                return
            except errors.ServiceError as error:
                if not error.is_refusal:
                    log.warning("response not stored (key %s): %s", lease.id.key, error)
                    return
        log.warning("response too large to store (key %s): retries get a 500", lease.id.key)
        document = self._document(500, "response-not-replayable",
                                  "the request was processed, but its response exceeded "
                                  f"{self.max_stored_bytes} bytes and cannot be replayed")
        try:
            self.client.fail(lease.id, lease.fencing_token, retryable=False, error_response=StoredResponse(
                500, document, {"content-type": "application/problem+json"}))
        except errors.ServiceError as error:
            log.warning("could not store the failure (key %s): %s", lease.id.key, error)

    def _document(self, status: int, kind: str, detail: str) -> bytes:
        return json.dumps({"type": self.problem_type_base + kind, "title": _TITLES.get(status, "Error"),
                           "status": status, "detail": detail}).encode()

    async def _problem(self, send: Send, status: int, kind: str, detail: str,
                       extra: Sequence[Tuple[bytes, bytes]] = ()) -> None:
        document = self._document(status, kind, detail)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/problem+json"), *extra]})
        await send({"type": "http.response.body", "body": document})


_TITLES = {400: "Bad Request", 409: "Conflict", 413: "Payload Too Large", 422: "Unprocessable Entity",
           500: "Internal Server Error", 503: "Service Unavailable"}


async def _in_thread(function: Callable[..., Any], *args: Any) -> Any:
    """A blocking gRPC call, off the event loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, functools.partial(function, *args))


def _release(client: Client, lease: Lease) -> None:
    try:
        client.fail(lease.id, lease.fencing_token, retryable=True)
    except errors.ServiceError as error:
        log.warning("could not release the key %s: %s", lease.id.key, error)


def _read_key(values: List[bytes]) -> Tuple[Optional[str], str]:
    """The key (bare, or a structured-field string ``"..."``): 8-128 characters in 0x21-0x7E."""
    if len(values) > 1:
        return None, "the Idempotency-Key header must appear once"
    try:
        value = values[0].decode("ascii").strip()
    except UnicodeDecodeError:
        return None, "the Idempotency-Key must be printable ASCII"
    if len(value) >= 2 and value.startswith('"') and value.endswith('"'):
        value = value[1:-1]
    if not 8 <= len(value) <= 128:
        return None, "the Idempotency-Key must be 8 to 128 characters"
    if not all(0x21 <= ord(c) <= 0x7E for c in value):
        return None, "the Idempotency-Key must be printable ASCII without spaces"
    return value, ""


async def _read_body(receive: Receive, limit: int) -> Optional[bytes]:
    chunks: List[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay_body(body: bytes) -> Receive:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


def _operation(scope: Scope) -> str:
    route = getattr(scope.get("route"), "path", None) or scope.get("path", "/")
    operation = f"{scope['method'].upper()} {route}"
    if len(operation) <= 128 and all(0x20 <= ord(c) <= 0x7E for c in operation):
        return operation
    # A long path, or one with other characters, is kept distinct by its hash.
    return f"{scope['method'].upper()} #{hashlib.sha256(route.encode('utf-8', 'surrogatepass')).hexdigest()[:32]}"


def _request_fingerprint(scope: Scope, body: bytes, exclude: Sequence[str]) -> bytes:
    """SHA-256 of (SHA-256 of path and query) + (the body's fingerprint), as the Rust layer."""
    target = scope.get("raw_path") or scope.get("path", "/").encode()
    if scope.get("query_string"):
        target += b"?" + scope["query_string"]
    content_type = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == b"content-type"), "")
    mime = content_type.split(";")[0].strip().lower()
    body_fingerprint = fingerprint.bytes_(body)
    if mime == "application/json" or mime.endswith("+json"):
        try:
            body_fingerprint = fingerprint.json_bytes(body, exclude)
        except fingerprint.FingerprintError:
            pass
    return fingerprint.bytes_(fingerprint.bytes_(target) + body_fingerprint)


def _replayable(headers: Sequence[Tuple[bytes, bytes]], allowed: set) -> Dict[str, str]:
    stored: Dict[str, List[str]] = {}
    for name, value in headers:
        lowered = name.decode("latin-1").lower()
        if lowered in allowed:
            try:
                stored.setdefault(lowered, []).append(value.decode("utf-8"))
            except UnicodeDecodeError:
                log.warning("a header value that is not UTF-8 is not stored: %s", lowered)
    return {name: ", ".join(values) for name, values in stored.items()}


async def _send_stored(send: Send, stored: StoredResponse) -> None:
    status = stored.status_code if 100 <= stored.status_code <= 999 else 500
    headers = [(name.encode(), value.encode()) for name, value in stored.headers.items()]
    headers.append((b"idempotent-replayed", b"true"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": stored.body})
