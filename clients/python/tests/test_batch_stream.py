"""BatchStream (idempotency.v1.IdempotencyStreamService) through grpcio's
generated stub, as a black-box client of the real server: each message is
answered under its own id as its unary batch call would be, a message's
failure answers that message alone and the stream goes on, and closing our
side ends the stream OK after every message read was answered."""

from __future__ import annotations

import json
import queue
import uuid
from typing import Dict, Iterator, List, Optional

import grpc
import pytest
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2

from conftest import Server, wait_until
from idempotency_client._pb.idempotency.v1 import idempotency_pb2 as pb
from idempotency_client._pb.idempotency.v1 import idempotency_pb2_grpc as pb_grpc

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]  # 3
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
# A whole stream's deadline: a server that never answers fails the test
# (DEADLINE_EXCEEDED) rather than hanging it.
DEADLINE = 10.0


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # --log-calls: one line per call, with its trace id, to check that a
    # message's traceparent reaches the server.
    running = Server(["--log-calls"])
    yield running
    running.stop()


@pytest.fixture
def channel(server: Server) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.target) as opened:
        yield opened


def record_id(name: str) -> pb.RecordId:
    """A record no other test uses; its key is 8-128 printable ASCII."""
    return pb.RecordId(namespace="payments", operation="POST /payments", subject="user-42",
                       key=f"{name}-{uuid.uuid4()}")


def acquire(message_id: int, *ids: pb.RecordId, **fields) -> pb.BatchStreamRequest:
    return pb.BatchStreamRequest(
        id=message_id,
        acquire=pb.BatchAcquireRequest(requests=[pb.AcquireRequest(id=i, fingerprint=b"fp") for i in ids]),
        **fields,
    )


def complete(message_id: int, *items: tuple) -> pb.BatchStreamRequest:
    return pb.BatchStreamRequest(
        id=message_id,
        complete=pb.BatchCompleteRequest(requests=[
            pb.CompleteRequest(id=i, fencing_token=token,
                               response=pb.StoredResponse(status_code=201, body=b'{"id":1}'))
            for i, token in items
        ]),
    )


def acquired_tokens(answer: pb.BatchStreamResponse) -> List[int]:
    """The fencing tokens of an answer whose every item was ACQUIRED."""
    assert answer.WhichOneof("result") == "acquire", answer
    tokens = []
    for result in answer.acquire.results:
        assert result.WhichOneof("result") == "response", result
        assert result.response.WhichOneof("outcome") == "acquired", result
        assert result.response.acquired.fencing_token > 0, result
        tokens.append(result.response.acquired.fencing_token)
    return tokens


def bad_request_fields(status: status_pb2.Status) -> List[str]:
    fields = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            assert detail.Unpack(bad)
            fields.extend(violation.field for violation in bad.field_violations)
    return fields


def error_reason(status: status_pb2.Status) -> Optional[str]:
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            assert detail.Unpack(info)
            return info.reason
    return None


def logged_traces(server: Server, rpc: str) -> List[str]:
    """The trace ids of the calls of ``rpc`` the server logged."""
    traces = []
    for line in list(server.log):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("target") == "idempotency_server::calls" and entry.get("rpc") == rpc:
            traces.append(entry.get("span", {}).get("trace_id"))
    return traces


class Stream:
    """One BatchStream call whose requests are sent one at a time: the
    request iterator is a generator reading a queue, ``close`` makes it
    return (the client half-closes)."""

    _END = object()

    def __init__(self, channel: grpc.Channel) -> None:
        self._outbox: "queue.Queue[object]" = queue.Queue()
        stub = pb_grpc.IdempotencyStreamServiceStub(channel)
        self.call = stub.BatchStream(self._requests(), timeout=DEADLINE)

    def _requests(self) -> Iterator[pb.BatchStreamRequest]:
        while True:
            message = self._outbox.get()
            if message is self._END:
                return
            yield message

    def send(self, message: pb.BatchStreamRequest) -> None:
        self._outbox.put(message)

    def answer(self) -> pb.BatchStreamResponse:
        return next(self.call)

    def close(self) -> List[pb.BatchStreamResponse]:
        """Half-closes and reads to the stream's end: the answers left (a
        status other than OK raises grpc.RpcError)."""
        self._outbox.put(self._END)
        return list(self.call)

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self._outbox.put(self._END)
        self.call.cancel()  # a no-op once the stream ended


def test_one_stream_acquires_fails_one_message_alone_completes_then_ends_ok(
        channel: grpc.Channel) -> None:
    first, second = record_id("stream-a"), record_id("stream-b")
    with Stream(channel) as stream:
        stream.send(acquire(1, first, second))
        answer = stream.answer()
        assert answer.id == 1
        tokens = acquired_tokens(answer)
        assert len(tokens) == 2

        # A message without a batch fails alone, the field named.
        stream.send(pb.BatchStreamRequest(id=2))
        answer = stream.answer()
        assert answer.id == 2
        assert answer.WhichOneof("result") == "error", answer
        assert answer.error.code == INVALID_ARGUMENT
        assert "batch" in bad_request_fields(answer.error), answer.error
        assert error_reason(answer.error) == "INVALID_ARGUMENT", answer.error

        # The stream went on: both keys complete with their tokens.
        stream.send(complete(3, (first, tokens[0]), (second, tokens[1])))
        answer = stream.answer()
        assert answer.id == 3
        assert answer.WhichOneof("result") == "complete", answer
        assert len(answer.complete.results) == 2
        for result in answer.complete.results:
            assert result.WhichOneof("result") == "response", result
            assert result.response.completed_at.seconds > 0, result

        # Closing our side ends the stream OK, nothing left unanswered.
        assert stream.close() == []
        assert stream.call.code() == grpc.StatusCode.OK

    # The Completes did run: the records are COMPLETED (unary Get).
    unary = pb_grpc.IdempotencyServiceStub(channel)
    for record in (first, second):
        got = unary.Get(pb.GetRequest(id=record), timeout=DEADLINE)
        assert got.record.state == pb.RECORD_STATE_COMPLETED, got


def test_a_message_with_its_own_timeout_and_traceparent_is_served_in_that_trace(
        server: Server, channel: grpc.Channel) -> None:
    record = record_id("stream-traced")
    with Stream(channel) as stream:
        stream.send(acquire(7, record, timeout=duration_pb2.Duration(seconds=5),
                            traceparent=TRACEPARENT))
        answer = stream.answer()
        assert answer.id == 7
        assert len(acquired_tokens(answer)) == 1

        # A timeout that is not positive fails that message alone.
        stream.send(acquire(8, record_id("stream-no-time"), timeout=duration_pb2.Duration()))
        answer = stream.answer()
        assert answer.id == 8
        assert answer.WhichOneof("result") == "error", answer
        assert answer.error.code == INVALID_ARGUMENT
        assert "timeout" in bad_request_fields(answer.error), answer.error

        assert stream.close() == []
        assert stream.call.code() == grpc.StatusCode.OK

    # The message's call was logged in the caller's trace (--log-calls; the
    # log is read by another thread, hence the wait).
    assert wait_until(lambda: TRACE_ID in logged_traces(server, "BatchAcquire")), \
        "\n".join(server.log[-30:])


def test_answers_are_told_apart_by_their_echoed_ids(channel: grpc.Channel) -> None:
    # Sent at once, each with as many keys as its id; answers may come in
    # any order, so they are matched by id.
    sizes = {100: 1, 2**64 - 1: 2, 5: 3, 42: 4}
    sent = [acquire(message_id, *(record_id(f"stream-{message_id}-{n}") for n in range(size)))
            for message_id, size in sizes.items()]
    call = pb_grpc.IdempotencyStreamServiceStub(channel).BatchStream(iter(sent), timeout=DEADLINE)

    answers: Dict[int, pb.BatchStreamResponse] = {}
    for answer in call:  # to the end: the requests ran out, so we half-closed
        assert answer.id not in answers, f"id {answer.id} answered twice"
        answers[answer.id] = answer

    assert call.code() == grpc.StatusCode.OK
    assert set(answers) == set(sizes)
    for message_id, size in sizes.items():
        assert len(acquired_tokens(answers[message_id])) == size, answers[message_id]
