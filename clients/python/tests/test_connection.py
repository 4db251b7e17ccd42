"""The client's connection going away under it: a server restarted, a proxy
or load balancer dropping its connections. The next calls must get through
(grpcio reconnects; what fails meanwhile is retried as transient). And the
channel options a caller gives."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from typing import Optional, Set

import grpc
import pytest

from conftest import Server, record_id
from idempotency_client import (
    NO_RETRIES,
    Acquired,
    AcquireRequest,
    Client,
    RetryPolicy,
    StoredResponse,
    Unavailable,
)


class TcpProxy:
    """Forwards a local port to ``target``. ``cut()`` closes the listener and
    every forwarded connection at once (no GOAWAY, as a killed server or a
    restarted proxy does); ``refuse()`` does too but keeps listening and
    closes each connection it accepts at once, counting them in ``refused``
    (each is one attempt of the client to reconnect); ``restore()`` forwards
    again, on the same port. ``forwarded`` counts the connections forwarded."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._lock = threading.Lock()
        self._open: Set[socket.socket] = set()
        self._listener: Optional[socket.socket] = None
        self._refusing = False
        self.refused = 0
        self.forwarded = 0
        self.port = 0
        self.restore()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def restore(self) -> None:
        with self._lock:
            self._refusing = False
            if self._listener is not None:
                return
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def refuse(self) -> None:
        with self._lock:
            self._refusing = True
            doomed, self._open = self._open, set()
        for connection in doomed:
            _close(connection)

    def cut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            doomed, self._open = self._open, set()
        if listener is not None:
            _close(listener)
        for connection in doomed:
            _close(connection)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                downstream, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                refusing = self._refusing
            if refusing:
                self.refused += 1  # only this thread writes it
                _close(downstream)
                continue
            try:
                upstream = socket.create_connection(self._upstream)
            except OSError:
                _close(downstream)
                continue
            with self._lock:
                # Cut, or refusing, since it was accepted: it must not outlive that.
                if self._listener is not listener or self._refusing:
                    _close(downstream)
                    _close(upstream)
                    continue
                self._open.update((downstream, upstream))
                self.forwarded += 1
            for source, sink in ((downstream, upstream), (upstream, downstream)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        _close(sink)
        _close(source)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept or recv
    except OSError:
        pass
    sock.close()


def _acquire(client: Client, name: str) -> object:
    return client.acquire(AcquireRequest(record_id(f"{name}-{uuid.uuid4()}"), b"fingerprint"))


def test_calls_after_the_connection_dropped_get_through(server: Server) -> None:
    proxy = TcpProxy(server.target)
    try:
        with Client(proxy.target, timeout=5) as client:
            # The call right after a drop races grpcio's noticing it; each
            # round gives the race another chance.
            for round_ in range(20):
                assert isinstance(_acquire(client, f"before{round_}"), Acquired)
                proxy.cut()
                proxy.restore()
                assert isinstance(_acquire(client, f"after{round_}"), Acquired), f"round {round_}"
    finally:
        proxy.cut()


def test_while_the_service_stays_away_a_call_fails_as_unavailable_after_its_retries(server: Server) -> None:
    proxy = TcpProxy(server.target)
    retry = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.05, max_elapsed=2)
    try:
        with Client(proxy.target, timeout=2, retry=retry) as client:
            assert isinstance(_acquire(client, "up"), Acquired)
            proxy.cut()
            with pytest.raises(Unavailable) as failure:
                _acquire(client, "down")
            assert failure.value.attempts == 3
    finally:
        proxy.cut()


def test_after_an_outage_the_client_reconnects_within_a_second_or_so(server: Server) -> None:
    # grpcio waits between attempts to reconnect, each wait longer (1 s, then
    # x1.6 up to 120 s by default), and fails calls at once meanwhile: a
    # client that saw a long outage would stay blind to the service's return
    # for as long as its last wait. The client caps the wait at 1 s.
    proxy = TcpProxy(server.target)
    try:
        with Client(proxy.target, timeout=2, retry=NO_RETRIES) as client:
            assert isinstance(_acquire(client, "up"), Acquired)
            proxy.refuse()
            # Six failed reconnections: with grpcio's defaults 14-16 s
            # of outage, and a next wait of about 10 s.
            give_up = time.monotonic() + 60
            while proxy.refused < 6:
                assert time.monotonic() < give_up, f"{proxy.refused} reconnections in 60 s"
                with pytest.raises(Unavailable):
                    _acquire(client, "down")
                time.sleep(0.05)
            proxy.restore()
            back = time.monotonic()
            while True:
                try:
                    assert isinstance(_acquire(client, "back"), Acquired)
                    break
                except Unavailable:
                    assert time.monotonic() - back < 5, "no call got through in 5 s"
                    time.sleep(0.05)
    finally:
        proxy.cut()


def test_channel_options_replace_the_clients_defaults(server: Server) -> None:
    # The client sets no cap on answers (-1); a caller's cap must win.
    record = record_id(f"big-{uuid.uuid4()}")
    with Client(server.target) as client:
        acquired = client.acquire(AcquireRequest(record, b"fingerprint"))
        assert isinstance(acquired, Acquired)
        client.complete(record, acquired.fencing_token, StoredResponse(200, b"x" * 8192))
    capped = Client(server.target, retry=NO_RETRIES, channel_options=[("grpc.max_receive_message_length", 1024)])
    with capped:
        with pytest.raises(Unavailable) as too_large:
            capped.acquire(AcquireRequest(record, b"fingerprint"))
    assert too_large.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_calls_go_on_across_the_servers_connection_age() -> None:
    # The server ends each connection after --max-connection-age with a
    # GOAWAY (README): calls in flight finish and the client reconnects, so
    # none fails, even without retries.
    aging = Server(["--max-connection-age", "300ms"])
    proxy = TcpProxy(aging.target)
    try:
        with Client(proxy.target, timeout=5, retry=NO_RETRIES) as client:
            ends = time.monotonic() + 2
            calls = 0
            while time.monotonic() < ends:
                assert isinstance(_acquire(client, f"aging{calls}"), Acquired), f"call {calls}"
                calls += 1
                time.sleep(0.02)
        assert calls > 20
        # The calls did cross connections' ends (about one every 0.3 s).
        assert proxy.forwarded >= 3, proxy.forwarded
    finally:
        proxy.cut()
        aging.stop()
