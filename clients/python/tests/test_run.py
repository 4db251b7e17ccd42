"""Client.run against the real server: once per key, replays, failures,
the lease kept alive or lost, fail open or closed."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List

import pytest

from conftest import Server, free_port, record_id
from idempotency_client import (
    RETRYABLE,
    Acquired,
    AcquireRequest,
    Attempt,
    Client,
    InProgress,
    OnUnavailable,
    Outcome,
    RecordState,
    RetryPolicy,
    RunFingerprintMismatch,
    RunInProgress,
    RunLeaseLost,
    RunOptions,
    RunPreviouslyFailed,
    StoredResponse,
    Terminal,
    Unavailable,
    fingerprint,
)


def request(key: str, amount: int = 1000, **kwargs) -> AcquireRequest:
    return AcquireRequest(record_id(key), fingerprint.json({"amount": amount}), **kwargs)


class Charge:
    """A business operation that counts its runs."""

    def __init__(self, pause: float = 0.0) -> None:
        self.runs = 0
        self.tokens: List[int] = []
        self.pause = pause
        self._lock = threading.Lock()

    def __call__(self, attempt: Attempt) -> StoredResponse:
        with self._lock:
            self.runs += 1
            self.tokens.append(attempt.fencing_token or 0)
        time.sleep(self.pause)
        return StoredResponse(201, b'{"id":"pay_1"}', {"content-type": "application/json"})


class Declined(Exception):
    pass


def test_run_executes_once_and_replays_duplicates(client: Client, key: str) -> None:
    charge = Charge()

    first = client.run(request(key), charge)
    second = client.run(request(key), charge)

    assert first.outcome is Outcome.EXECUTED and not first.replayed
    assert second.outcome is Outcome.REPLAYED and second.replayed
    assert first.response == second.response
    assert charge.runs == 1


def test_32_concurrent_duplicates_run_the_function_once(server: Server, key: str) -> None:
    charge = Charge(pause=0.3)
    options = RunOptions(wait_in_progress=20)
    with Client(server.target) as shared:
        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(lambda _: shared.run(request(key), charge, options), range(32)))

    assert charge.runs == 1
    assert [r.outcome for r in results].count(Outcome.EXECUTED) == 1
    assert [r.outcome for r in results].count(Outcome.REPLAYED) == 31
    assert all(r.response.status_code == 201 for r in results)


def test_a_duplicate_during_the_run_is_in_progress(client: Client, key: str) -> None:
    seen = []

    def work(attempt: Attempt) -> StoredResponse:
        with pytest.raises(RunInProgress) as duplicate:
            client.run(request(key), Charge())
        seen.append(duplicate.value.retry_after)
        return StoredResponse(200)

    client.run(request(key), work)

    assert len(seen) == 1 and 0 < seen[0] <= 1.0


def test_another_request_under_the_key_is_a_mismatch(client: Client, key: str) -> None:
    client.run(request(key, 1000), Charge())

    with pytest.raises(RunFingerprintMismatch):
        client.run(request(key, 2000), Charge())


def test_an_exception_releases_the_key_and_a_retry_runs_again(client: Client, key: str) -> None:
    def broken(attempt: Attempt) -> StoredResponse:
        raise TimeoutError("the bank did not answer")

    with pytest.raises(TimeoutError):
        client.run(request(key), broken)
    released = client.get(record_id(key))
    retried = client.run(request(key), Charge())

    assert released is not None and released.state is RecordState.RELEASED
    assert retried.outcome is Outcome.EXECUTED


def test_a_terminal_failure_is_stored_and_replayed_without_running(client: Client, key: str) -> None:
    def declined(attempt: Attempt) -> StoredResponse:
        raise Declined("card declined")

    options = RunOptions(classify=lambda error: Terminal(StoredResponse(402, str(error)))
                         if isinstance(error, Declined) else RETRYABLE)
    charge = Charge()

    with pytest.raises(Declined):
        client.run(request(key), declined, options)
    with pytest.raises(RunPreviouslyFailed) as replayed:
        client.run(request(key), charge, options)

    assert replayed.value.response == StoredResponse(402, b"card declined")
    assert charge.runs == 0


def test_keep_alive_holds_the_key_past_the_first_lease(client: Client, key: str) -> None:
    during: List[object] = []

    def long_work(attempt: Attempt) -> StoredResponse:
        time.sleep(1.6)  # past the 1 s lease asked for
        during.append(client.acquire(request(key)))
        time.sleep(0.6)
        return StoredResponse(200, b"done")

    ran = client.run(request(key, lease=1), long_work, RunOptions(keep_alive=1))

    assert ran.outcome is Outcome.EXECUTED
    assert isinstance(during[0], InProgress), during


def test_without_keep_alive_a_takeover_loses_the_lease(client: Client, key: str) -> None:
    def slow(attempt: Attempt) -> StoredResponse:
        time.sleep(1.2)  # the 1 s lease passes: another attempt takes the key over
        assert isinstance(client.acquire(request(key, lease=30)), Acquired)
        return StoredResponse(200, b"late")

    with pytest.raises(RunLeaseLost) as lost:
        client.run(request(key, lease=1), slow)

    assert lost.value.response == StoredResponse(200, b"late")


def test_keep_alive_tells_the_function_when_its_lease_is_taken_over(client: Client, key: str) -> None:
    noticed = []

    def work(attempt: Attempt) -> StoredResponse:
        assert attempt.fencing_token is not None
        # Another actor gives the key away and takes it: the next renewal is refused.
        client.fail(record_id(key), attempt.fencing_token, retryable=True)
        assert isinstance(client.acquire(request(key, lease=30)), Acquired)
        noticed.append(attempt.lease_lost.wait(5))
        return StoredResponse(200)

    with pytest.raises(RunLeaseLost):
        client.run(request(key, lease=3), work, RunOptions(keep_alive=3, keep_alive_every=0.1))

    assert noticed == [True]


def test_waiting_for_an_attempt_in_progress_returns_its_response(client: Client, key: str) -> None:
    started = threading.Event()

    def slow(attempt: Attempt) -> StoredResponse:
        started.set()
        time.sleep(0.8)
        return StoredResponse(201, b"first")

    worker = threading.Thread(target=client.run, args=(request(key), slow))
    worker.start()
    assert started.wait(5)
    charge = Charge()
    ran = client.run(request(key), charge, RunOptions(wait_in_progress=10))
    worker.join()

    assert ran.outcome is Outcome.REPLAYED and ran.response.body == b"first"
    assert charge.runs == 0


UNREACHABLE = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.05, max_elapsed=2)


def test_fail_closed_refuses_when_the_service_is_unreachable(key: str) -> None:
    charge = Charge()
    with Client(f"127.0.0.1:{free_port()}", timeout=2, retry=UNREACHABLE) as down:
        with pytest.raises(Unavailable) as error:
            down.run(request(key), charge)

    assert error.value.attempts == 3 and error.value.is_unavailable
    assert charge.runs == 0


def test_fail_open_runs_unprotected_when_the_service_is_unreachable(key: str) -> None:
    charge = Charge()
    with Client(f"127.0.0.1:{free_port()}", timeout=2, retry=UNREACHABLE) as down:
        ran = down.run(request(key), charge, RunOptions(on_unavailable=OnUnavailable.FAIL_OPEN))

    assert ran.outcome is Outcome.UNPROTECTED
    assert charge.runs == 1 and charge.tokens == [0]


def test_the_function_must_return_a_stored_response(client: Client, key: str) -> None:
    with pytest.raises(TypeError):
        client.run(request(key), lambda attempt: "not a response")  # type: ignore[arg-type,return-value]

    record = client.get(record_id(key))
    assert record is not None and record.state is RecordState.FAILED
    assert record.response is not None and record.response.status_code == 500
