"""What the client sends and how it retries, against a fake service that
records each call's metadata: a W3C traceparent on every RPC (OpenTelemetry's
when a span is active), the trace id logged, retries of transient errors only."""

from __future__ import annotations

import logging
import re
from concurrent import futures
from typing import Iterator, List, Tuple

import grpc
import pytest

from conftest import record_id
from idempotency_client import Client, NotFound, RetryPolicy, Unavailable
from idempotency_client._pb.idempotency.v1 import idempotency_pb2, idempotency_pb2_grpc

TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


class Fake(idempotency_pb2_grpc.IdempotencyServiceServicer):
    """Get and Renew answer the next code of ``answers`` (OK when none is left)."""

    def __init__(self) -> None:
        self.calls: List[dict] = []
        self.answers: List[grpc.StatusCode] = []

    def Get(self, request, context):  # noqa: N802 (gRPC's name)
        self.calls.append(dict(context.invocation_metadata()))
        code = self.answers.pop(0) if self.answers else grpc.StatusCode.OK
        if code != grpc.StatusCode.OK:
            context.abort(code, f"fake {code.name}")
        return idempotency_pb2.GetResponse(
            record=idempotency_pb2.Record(id=request.id, state=idempotency_pb2.RECORD_STATE_RELEASED)
        )

    def Renew(self, request, context):  # noqa: N802 (gRPC's name)
        self.calls.append(dict(context.invocation_metadata()))
        code = self.answers.pop(0) if self.answers else grpc.StatusCode.OK
        if code != grpc.StatusCode.OK:
            context.abort(code, f"fake {code.name}")
        return idempotency_pb2.RenewResponse()


@pytest.fixture
def fake() -> Iterator[Tuple[Fake, str]]:
    service = Fake()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    idempotency_pb2_grpc.add_IdempotencyServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield service, f"127.0.0.1:{port}"
    server.stop(0)


FAST = RetryPolicy(max_attempts=4, initial_backoff=0.001, max_backoff=0.01, max_elapsed=5)


def test_every_call_sends_a_fresh_traceparent_and_logs_its_trace_id(fake, caplog) -> None:
    service, target = fake
    caplog.set_level(logging.DEBUG, logger="idempotency_client")
    with Client(target) as client:
        client.get(record_id("key-trace-1"))
        client.get(record_id("key-trace-2"))

    ids = [TRACEPARENT.match(call["traceparent"]).group(1) for call in service.calls]
    assert len(set(ids)) == 2
    for trace_id in ids:
        assert any(trace_id in message for message in caplog.messages), caplog.messages


def test_retries_of_one_call_share_its_trace_id(fake) -> None:
    service, target = fake
    service.answers = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]
    with Client(target, retry=FAST) as client:
        record = client.get(record_id("key-retry"))

    assert record is not None
    parents = [TRACEPARENT.match(call["traceparent"]) for call in service.calls]
    assert len(parents) == 3
    assert len({p.group(1) for p in parents}) == 1, "one trace"
    assert len({p.group(2) for p in parents}) == 3, "a span id per attempt"


def test_transient_errors_are_retried_up_to_the_policy(fake) -> None:
    service, target = fake
    service.answers = [grpc.StatusCode.UNAVAILABLE] * 10
    with Client(target, retry=FAST) as client:
        with pytest.raises(Unavailable) as error:
            client.get(record_id("key-down"))

    assert error.value.attempts == 4 and len(service.calls) == 4
    assert error.value.code == grpc.StatusCode.UNAVAILABLE


def test_other_errors_are_not_retried(fake) -> None:
    service, target = fake
    service.answers = [grpc.StatusCode.FAILED_PRECONDITION]
    with Client(target, retry=FAST) as client:
        with pytest.raises(Exception) as error:
            client.get(record_id("key-refused"))

    assert len(service.calls) == 1
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]


def test_not_found_is_none_from_get(fake) -> None:
    service, target = fake
    service.answers = [grpc.StatusCode.NOT_FOUND]
    with Client(target) as client:
        assert client.get(record_id("key-missing")) is None
    service.answers = [grpc.StatusCode.NOT_FOUND]
    with Client(target) as client, pytest.raises(NotFound):
        client.renew(record_id("key-missing"), 1, 5)


def test_the_active_opentelemetry_span_is_propagated(fake) -> None:
    trace = pytest.importorskip("opentelemetry.trace")
    sdk = pytest.importorskip("opentelemetry.sdk.trace")
    service, target = fake
    tracer = sdk.TracerProvider().get_tracer("test")

    with tracer.start_as_current_span("checkout") as span:
        with Client(target) as client:
            client.get(record_id("key-otel"))
        context = span.get_span_context()

    sent = TRACEPARENT.match(service.calls[0]["traceparent"])
    assert sent.group(1) == format(context.trace_id, "032x")
    assert sent.group(2) == format(context.span_id, "016x")
    assert trace.get_current_span().get_span_context().is_valid is False


def test_the_stubs_coexist_with_googleapis_common_protos() -> None:
    # Both register google/rpc/status.proto's types only once: the service's
    # stubs use googleapis-common-protos' module instead of their own.
    from google.rpc import error_details_pb2, status_pb2

    assert idempotency_pb2.BatchAcquireResult.DESCRIPTOR.fields_by_name["error"].message_type \
        is status_pb2.Status.DESCRIPTOR
    assert error_details_pb2.ErrorInfo.DESCRIPTOR.full_name == "google.rpc.ErrorInfo"
