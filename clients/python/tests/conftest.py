"""Fixtures: the real server (``target/debug/idempotencyd``) on a fresh
database per test module, started on a free port and stopped afterwards.

Needs ``DATABASE_URL`` (a role that may CREATE DATABASE; ``scripts/with-postgres.sh``
provides one) and the built binary (``cargo build -p idempotency-server``);
``IDEMPOTENCYD`` names another binary. ``TEST_LOG=1`` prints the server's log.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator, List, Optional, Sequence

import pytest

from idempotency_client import Client, RecordId

ROOT = Path(__file__).resolve().parents[3]
BINARY = Path(os.environ.get("IDEMPOTENCYD", ROOT / "target" / "debug" / "idempotencyd"))


def _admin_url() -> str:
    url = os.environ.get("DATABASE_URL")
    if not url:
        pytest.fail(
            "DATABASE_URL is not set: run under scripts/with-postgres.sh "
            "(scripts/test-python.sh does) or point it at a Postgres that may CREATE DATABASE"
        )
    return url


def _psql(url: str, sql: str) -> None:
    subprocess.run(["psql", "-q", "-v", "ON_ERROR_STOP=1", url, "-c", sql], check=True,
                   stdout=subprocess.DEVNULL)


class Server:
    """A running idempotencyd on its own database."""

    def __init__(self, args: Sequence[str] = (), env: Optional[dict] = None) -> None:
        if not BINARY.is_file():
            pytest.fail(f"{BINARY} is missing: build it with `cargo build -p idempotency-server`")
        admin = _admin_url()
        self.database = f"idem_py_{uuid.uuid4().hex[:12]}"
        _psql(admin, f"CREATE DATABASE {self.database}")
        self._admin = admin
        self.log: List[str] = []
        self._ready = threading.Event()
        self.addr: Optional[str] = None
        self.process = subprocess.Popen(
            [str(BINARY), "serve", "--migrate", "--grpc-addr", "127.0.0.1:0",
             "--metrics-addr", "127.0.0.1:0", "--log-format", "json", *args],
            env={**os.environ, **(env or {}), "DATABASE_URL": admin.rsplit("/", 1)[0] + "/" + self.database},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(60) or self.addr is None:
            self.stop()
            raise RuntimeError("idempotencyd did not start:\n" + "\n".join(self.log[-30:]))

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.log.append(line.rstrip("\n"))
            if os.environ.get("TEST_LOG"):
                print("idempotencyd:", line, end="")
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if "mode" in entry and "addr" in entry and self.addr is None:
                self.addr = entry["addr"]
                self._ready.set()
        self._ready.set()  # exited before serving

    @property
    def target(self) -> str:
        assert self.addr is not None
        return self.addr

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        _psql(self._admin, f"DROP DATABASE IF EXISTS {self.database} WITH (FORCE)")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    running = Server()
    yield running
    running.stop()


@pytest.fixture
def client(server: Server) -> Iterator[Client]:
    with Client(server.target, timeout=10) as connected:
        yield connected


@pytest.fixture
def key() -> str:
    """A key no other test uses (tests of a module share its database)."""
    return f"key-{uuid.uuid4()}"


def record_id(key: str, namespace: str = "payments") -> RecordId:
    return RecordId(namespace, "POST /payments", key, subject="user-42")


def free_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def token_files(directory: Path, tokens: dict, grants: Sequence[tuple]) -> List[str]:
    """Static-token and policy files (docs/security.md) and the flags naming them."""
    (directory / "tokens.toml").write_text("".join(
        f'[[token]]\nprincipal = "{principal}"\nsha256 = "{hashlib.sha256(token.encode()).hexdigest()}"\n\n'
        for token, principal in tokens.items()
    ))
    (directory / "policy.toml").write_text("".join(
        f'[[grant]]\nprincipals = ["{principal}"]\nnamespaces = ["{namespace}"]\nrole = "{role}"\n\n'
        for principal, namespace, role in grants
    ))
    return ["--static-tokens", str(directory / "tokens.toml"),
            "--auth-policy", str(directory / "policy.toml")]


def wait_until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()
