"""The ASGI middleware's HTTP contract against the real server, driven as an
ASGI server would (no web framework needed)."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Dict, List, Optional, Tuple

import pytest

from conftest import Server, free_port
from idempotency_client import Client, OnUnavailable, RetryPolicy
from idempotency_client.asgi import IdempotencyMiddleware, stores_by_default


class App:
    """An ASGI app answering ``status`` with a JSON body, counting its runs."""

    def __init__(self, status: int = 201, pause: float = 0.0) -> None:
        self.status, self.pause, self.runs, self.bodies = status, pause, 0, []  # type: ignore[var-annotated]
        self.running = threading.Event()

    async def __call__(self, scope, receive, send) -> None:
        self.runs += 1
        message = await receive()
        self.bodies.append(message.get("body", b""))
        self.running.set()
        await asyncio.sleep(self.pause)
        if self.status == 599:
            raise RuntimeError("the handler crashed")
        await send({"type": "http.response.start", "status": self.status,
                    "headers": [(b"content-type", b"application/json"), (b"x-internal", b"secret")]})
        await send({"type": "http.response.body", "body": json.dumps({"run": self.runs}).encode()})


def call(app, method: str = "POST", path: str = "/payments", key: Optional[str] = "key-asgi-0001",
         body: bytes = b'{"amount": 1000}', headers: Tuple[Tuple[bytes, bytes], ...] = ()) -> Tuple[int, Dict[str, str], bytes]:
    raw = [(b"content-type", b"application/json"), *headers]
    if key is not None:
        raw.append((b"idempotency-key", key.encode()))
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(),
             "query_string": b"", "headers": raw}
    sent: List[dict] = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = sent[0]
    answer = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], answer, b"".join(m.get("body", b"") for m in sent[1:])


@pytest.fixture
def client(server: Server):
    with Client(server.target) as connected:
        yield connected


def test_the_first_request_runs_and_a_retry_replays_it(client: Client, key: str) -> None:
    app = App()
    wrapped = IdempotencyMiddleware(app, client, "shop")

    first = call(wrapped, key=key)
    second = call(wrapped, key=key, body=b'{ "amount" : 1000 }')

    assert first[0] == 201 and "idempotent-replayed" not in first[1]
    assert second[0] == 201 and second[1]["idempotent-replayed"] == "true"
    assert second[2] == first[2] == b'{"run": 1}'
    assert second[1]["content-type"] == "application/json" and "x-internal" not in second[1]
    assert app.runs == 1


def test_another_body_under_the_key_is_422(client: Client, key: str) -> None:
    wrapped = IdempotencyMiddleware(App(), client, "shop")
    call(wrapped, key=key)

    status, headers, body = call(wrapped, key=key, body=b'{"amount": 2000}')

    assert status == 422 and headers["content-type"] == "application/problem+json"
    assert json.loads(body)["type"] == "urn:idempotency:problem:idempotency-key-reused"


def test_a_duplicate_while_the_first_runs_is_409_with_retry_after(client: Client, key: str) -> None:
    app = App(pause=1.0)
    wrapped = IdempotencyMiddleware(app, client, "shop")
    first = threading.Thread(target=call, args=(wrapped,), kwargs={"key": key})
    first.start()
    assert app.running.wait(5)

    status, headers, _ = call(wrapped, key=key)
    first.join()

    assert status == 409 and int(headers["retry-after"]) >= 1
    assert app.runs == 1


@pytest.mark.parametrize("status", [500, 429, 409, 408, 425])
def test_a_not_now_answer_releases_the_key(client: Client, key: str, status: int) -> None:
    app = App(status=status)
    wrapped = IdempotencyMiddleware(app, client, "shop")

    call(wrapped, key=key)
    again = call(wrapped, key=key)

    assert again[0] == status and "idempotent-replayed" not in again[1]
    assert app.runs == 2


def test_a_4xx_answer_is_stored(client: Client, key: str) -> None:
    app = App(status=402)
    wrapped = IdempotencyMiddleware(app, client, "shop")

    call(wrapped, key=key)
    again = call(wrapped, key=key)

    assert again[0] == 402 and again[1]["idempotent-replayed"] == "true" and app.runs == 1


def test_an_exception_releases_the_key(client: Client, key: str) -> None:
    app = App(status=599)
    wrapped = IdempotencyMiddleware(app, client, "shop")

    with pytest.raises(RuntimeError):
        call(wrapped, key=key)
    app.status = 201
    again = call(wrapped, key=key)

    assert again[0] == 201 and app.runs == 2


def test_keys_are_checked_and_optional_unless_required(client: Client) -> None:
    app = App()
    optional = IdempotencyMiddleware(app, client, "shop")
    required = IdempotencyMiddleware(app, client, "shop", require_key=True)

    assert call(optional, key=None)[0] == 201
    assert call(required, key=None)[0] == 400
    assert call(required, key="short")[0] == 400
    assert call(required, key='"quoted-key-0001"')[0] == 201
    assert call(required, method="GET", key=None)[0] == 201
    assert app.runs == 3


def test_a_response_too_large_to_store_answers_once_then_a_stored_500(client: Client, key: str) -> None:
    app = App()
    wrapped = IdempotencyMiddleware(app, client, "shop", max_stored_bytes=8)

    first = call(wrapped, key=key)
    again = call(wrapped, key=key)

    assert first[0] == 201 and app.runs == 1
    assert again[0] == 500 and again[1]["idempotent-replayed"] == "true"
    assert json.loads(again[2])["type"] == "urn:idempotency:problem:response-not-replayable"


def test_a_body_over_the_limit_is_413(client: Client, key: str) -> None:
    wrapped = IdempotencyMiddleware(App(), client, "shop", max_body_bytes=8)

    assert call(wrapped, key=key)[0] == 413


def test_an_unreachable_service_is_503_or_unprotected_when_failing_open(key: str) -> None:
    app = App()
    retry = RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.01, max_elapsed=1)
    with Client(f"127.0.0.1:{free_port()}", timeout=2, retry=retry) as down:
        closed = call(IdempotencyMiddleware(app, down, "shop"), key=key)
        opened = call(IdempotencyMiddleware(app, down, "shop", on_unavailable=OnUnavailable.FAIL_OPEN), key=key)

    assert closed[0] == 503
    assert opened[0] == 201 and app.runs == 1


def test_the_default_storage_rule() -> None:
    assert [s for s in (200, 201, 204, 400, 402, 404, 422) if not stores_by_default(s)] == []
    assert [s for s in (408, 409, 425, 429, 500, 502, 503) if stores_by_default(s)] == []
