"""The RPCs one by one against the real server: typed outcomes and errors."""

from __future__ import annotations

import time

import pytest

from conftest import record_id
from idempotency_client import (
    Acquired,
    AcquireRequest,
    Client,
    Completed,
    Failed,
    FingerprintMismatch,
    InProgress,
    InvalidArgument,
    LeaseLost,
    NotInProgress,
    RecordState,
    StoredResponse,
    fingerprint,
    reason,
)

BODY = {"amount": 1000, "currency": "EUR", "meta": {"trace_id": "abc"}}


def request(key: str, body=BODY, **kwargs) -> AcquireRequest:
    return AcquireRequest(record_id(key), fingerprint.json(body, ["/meta/trace_id"]), **kwargs)


def test_acquire_complete_then_a_duplicate_replays_the_stored_response(client: Client, key: str) -> None:
    first = client.acquire(request(key))
    assert isinstance(first, Acquired)
    assert first.fencing_token > 0 and first.lease_expires_at < first.expires_at

    completed_at = client.complete(first.id, first.fencing_token,
                                   StoredResponse(201, b'{"id":"pay_1"}', {"content-type": "application/json"}))
    # The same request with another trace id is the same request.
    again = client.acquire(request(key, {**BODY, "meta": {"trace_id": "other"}}))

    assert isinstance(again, Completed)
    assert again.response == StoredResponse(201, b'{"id":"pay_1"}', {"content-type": "application/json"})
    assert again.completed_at == completed_at


def test_a_live_attempt_answers_in_progress_with_a_retry_hint(client: Client, key: str) -> None:
    assert isinstance(client.acquire(request(key)), Acquired)

    second = client.acquire(request(key))

    assert isinstance(second, InProgress)
    assert 0 < second.retry_after <= 1.0
    assert second.lease_expires_at is not None


def test_the_key_reused_for_another_request_is_a_fingerprint_mismatch(client: Client, key: str) -> None:
    assert isinstance(client.acquire(request(key)), Acquired)

    other = client.acquire(request(key, {**BODY, "amount": 2000}))

    assert isinstance(other, FingerprintMismatch)


def test_a_terminal_failure_is_replayed(client: Client, key: str) -> None:
    acquired = client.acquire(request(key))
    assert isinstance(acquired, Acquired)

    state = client.fail(acquired.id, acquired.fencing_token, retryable=False,
                        error_response=StoredResponse(402, "card declined"))
    again = client.acquire(request(key))

    assert state is RecordState.FAILED
    assert isinstance(again, Failed)
    assert again.error_response == StoredResponse(402, b"card declined")


def test_a_retryable_failure_releases_the_key_for_a_larger_token(client: Client, key: str) -> None:
    first = client.acquire(request(key))
    assert isinstance(first, Acquired)

    state = client.fail(first.id, first.fencing_token, retryable=True)
    second = client.acquire(request(key))

    assert state is RecordState.RELEASED
    assert isinstance(second, Acquired) and second.fencing_token > first.fencing_token
    with pytest.raises(LeaseLost) as lost:
        client.complete(first.id, first.fencing_token, StoredResponse(200))
    assert lost.value.reason == reason.STALE_FENCING_TOKEN


def test_renew_extends_the_lease(client: Client, key: str) -> None:
    acquired = client.acquire(request(key, lease=2))
    assert isinstance(acquired, Acquired)

    renewed = client.renew(acquired.id, acquired.fencing_token, 30)

    assert renewed.lease_expires_at > acquired.lease_expires_at
    assert (renewed.lease_expires_at - acquired.lease_expires_at).total_seconds() > 20


def test_get_reads_the_record_or_none(client: Client, key: str) -> None:
    missing = client.get(record_id(key))
    acquired = client.acquire(request(key))
    assert isinstance(acquired, Acquired)
    in_progress = client.get(record_id(key))
    client.complete(acquired.id, acquired.fencing_token, StoredResponse(200, b"ok"))
    done = client.get(record_id(key))

    assert missing is None
    assert in_progress is not None and in_progress.state is RecordState.IN_PROGRESS
    assert in_progress.fencing_token == acquired.fencing_token
    assert in_progress.fingerprint == request(key).fingerprint
    assert in_progress.lease_expires_at is not None and in_progress.completed_at is None
    assert done is not None and done.state is RecordState.COMPLETED
    assert done.response == StoredResponse(200, b"ok") and done.completed_at is not None


def test_a_lease_taken_over_after_it_passed_cannot_complete(client: Client, key: str) -> None:
    first = client.acquire(request(key, lease=1))
    assert isinstance(first, Acquired)
    time.sleep(1.2)

    second = client.acquire(request(key, lease=1))

    assert isinstance(second, Acquired) and second.fencing_token > first.fencing_token
    with pytest.raises(LeaseLost):
        client.complete(first.id, first.fencing_token, StoredResponse(200))
    with pytest.raises(LeaseLost):
        client.renew(first.id, first.fencing_token, 5)


def test_renewing_a_finished_record_is_not_in_progress(client: Client, key: str) -> None:
    acquired = client.acquire(request(key))
    assert isinstance(acquired, Acquired)
    client.complete(acquired.id, acquired.fencing_token, StoredResponse(200))

    with pytest.raises(NotInProgress) as error:
        client.renew(acquired.id, acquired.fencing_token, 5)

    assert error.value.reason == reason.NOT_IN_PROGRESS


def test_an_invalid_field_is_named(client: Client) -> None:
    with pytest.raises(InvalidArgument) as error:
        client.acquire(AcquireRequest(record_id("short")))

    assert error.value.field == "id.key"
    assert error.value.reason == reason.INVALID_ARGUMENT
    assert error.value.is_refusal and not error.value.is_unavailable
