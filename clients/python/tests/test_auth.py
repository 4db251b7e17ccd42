"""Authentication errors surface typed: a server with static bearer tokens
(docs/security.md) refuses a missing or unknown token as Unauthenticated and
a namespace outside the caller's grants as PermissionDenied."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from conftest import Server, record_id, token_files
from idempotency_client import (
    Acquired,
    AcquireRequest,
    Client,
    OnUnavailable,
    PermissionDenied,
    RunOptions,
    StoredResponse,
    Unauthenticated,
    reason,
)

TOKEN = "py-test-token-5b0c2f"


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory: Path = tmp_path_factory.mktemp("auth")
    args = token_files(directory, {TOKEN: "py-importer"}, [("py-importer", "imports", "caller")])
    running = Server(args)
    yield running
    running.stop()


def test_a_granted_token_may_call(auth_server: Server, key: str) -> None:
    with Client(auth_server.target, token=TOKEN) as client:
        acquired = client.acquire(AcquireRequest(record_id(key, "imports")))
        assert isinstance(acquired, Acquired)
        client.complete(acquired.id, acquired.fencing_token, StoredResponse(200))


def test_a_call_without_a_token_is_unauthenticated(auth_server: Server, key: str) -> None:
    with Client(auth_server.target) as client:
        with pytest.raises(Unauthenticated) as error:
            client.get(record_id(key, "imports"))

    assert error.value.reason == reason.UNAUTHENTICATED
    assert not error.value.is_unavailable and not error.value.is_refusal


def test_an_unknown_token_is_unauthenticated_even_when_failing_open(auth_server: Server, key: str) -> None:
    ran = []
    with Client(auth_server.target, token="not-a-known-token") as client:
        with pytest.raises(Unauthenticated):
            client.run(AcquireRequest(record_id(key, "imports")),
                       lambda attempt: ran.append(1) or StoredResponse(200),
                       RunOptions(on_unavailable=OnUnavailable.FAIL_OPEN))

    assert ran == []


def test_a_namespace_outside_the_grant_is_permission_denied(auth_server: Server, key: str) -> None:
    with Client(auth_server.target, token=lambda: TOKEN) as client:
        with pytest.raises(PermissionDenied) as error:
            client.acquire(AcquireRequest(record_id(key, "payments")))

    assert error.value.reason == reason.NAMESPACE_FORBIDDEN
    assert "payments" in error.value.message


def test_a_token_source_with_no_token_sends_nothing(auth_server: Server, key: str) -> None:
    with Client(auth_server.target, token=lambda: None) as client:
        with pytest.raises(Unauthenticated) as error:
            client.get(record_id(key, "imports"))

    assert error.value.code is None  # never sent
