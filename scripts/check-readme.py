#!/usr/bin/env python3
"""Runs the README's console sessions against a fresh server, as a reader
pasting them would, and compares what they print with what the README shows.

A session is a ```console block right after a `<!-- readme-session: NAME -->`
line. Its `$ ` lines (with `\\` continuations) run in one bash, in order, so
variables carry over; the lines under a command are what it should print.

What "prints the same" means, since times, tokens and ids differ per run:
  * a JSON line is compared with the JSON the command printed (grpcurl
    pretty-prints; the README compacts): same keys at every level, same
    values, except timestamps and decimal-string numbers (fencing tokens),
    which need only be of that kind;
  * a line ending in `...}` is a prefix of a JSON line printed;
  * a `curl: (N) ...` line matches with its numbers left open;
  * any other line must be printed as is (headers, status lines, `Code:`;
    runs of blanks count as one), in the order shown; lines the README
    leaves out are fine.

The server is `target/debug/idempotencyd` on a database of its own in
DATABASE_URL's cluster; its ports and the examples' are free ones, put in
place of the README's (50051, 9090, 3000, 50052) in each command, and given
to the examples through their environment variables. A command ending in
`&` starts a background process (an example); the next command waits until
the port it names accepts connections.

Usage: scripts/check-readme.py [README.md]   (needs DATABASE_URL, psql, grpcurl, jq, curl)
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from urllib.parse import urlparse, urlunparse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORTS = {"50051": "grpc", "9090": "metrics", "3000": "http_example", "50052": "grpc_example"}
TIMESTAMP = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z$")
DECIMAL = re.compile(r"^-?\d+$")


def say(message):
    print(f"check-readme: {message}", file=sys.stderr, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port, seconds, what):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"check-readme: {what} did not listen on {port} within {seconds}s")


def sessions(readme):
    """(name, [(command, [expected lines])]) for every marked console block."""
    lines = open(readme, encoding="utf-8").read().splitlines()
    found, i = [], 0
    while i < len(lines):
        marker = re.match(r"<!-- readme-session: ([\w-]+) -->", lines[i])
        i += 1
        if not marker:
            continue
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        assert lines[i].startswith("```console"), f"{marker[1]}: no console block after the marker"
        i += 1
        steps = []
        while not lines[i].startswith("```"):
            line = lines[i]
            if line.startswith("$ "):
                command = line[2:]
                while command.endswith("\\"):
                    i += 1
                    command += "\n" + lines[i]
                steps.append((command, []))
            elif line.strip() and steps:
                steps[-1][1].append(line)
            i += 1
        found.append((marker[1], steps))
    return found


def same(expected, actual):
    """JSON `expected` (from the README) against `actual` (printed)."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and expected.keys() == actual.keys() and all(
            same(expected[k], actual[k]) for k in expected
        )
    if isinstance(expected, list):
        return isinstance(actual, list) and len(expected) == len(actual) and all(
            same(e, a) for e, a in zip(expected, actual)
        )
    if isinstance(expected, str) and isinstance(actual, str):
        for kind in (TIMESTAMP, DECIMAL):
            if kind.match(expected):
                return bool(kind.match(actual))
    return expected == actual


def json_documents(text):
    """Every JSON object or array printed: whole lines, or pretty-printed runs."""
    documents, decoder, position = [], json.JSONDecoder(), 0
    while True:
        match = re.compile(r"^[ \t]*[\[{]", re.M).search(text, position)
        if not match:
            return documents
        start = match.end() - 1
        try:
            document, end = decoder.raw_decode(text, start)
            documents.append((document, text[start:end]))
            position = end
        except json.JSONDecodeError:
            position = start + 1


def check_output(expected_lines, printed):
    """The first README line not found in `printed`, or None."""
    documents = json_documents(printed)
    # Runs of blanks compare as one space (grpcurl indents with tabs).
    plain = [" ".join(line.split()) for line in printed.splitlines()]
    cursor = 0
    for expected in expected_lines:
        line = expected.strip()
        if line.startswith(("{", "[")) and line.endswith("...}"):
            prefix = line[: -len("...}")]
            if not any(raw.replace("\n", "").startswith(prefix) for _, raw in documents):
                return expected
        elif line.startswith(("{", "[")):
            try:
                wanted = json.loads(line)
            except json.JSONDecodeError:
                return expected + "   (not JSON in the README)"
            if not any(same(wanted, document) for document, _ in documents):
                return expected
        else:
            pattern = re.escape(" ".join(line.split()))
            if line.startswith("curl: ("):
                pattern = re.sub(r"\d+", r"\\d+", pattern)
            for at in range(cursor, len(plain)):
                if re.fullmatch(pattern, plain[at]):
                    cursor = at + 1
                    break
            else:
                return expected
    return None


def start_server(env, ports, log):
    database = f"readme_{uuid.uuid4().hex[:12]}"
    admin_url = env["DATABASE_URL"]
    subprocess.run(["psql", "-q", "-v", "ON_ERROR_STOP=1", admin_url, "-c", f"CREATE DATABASE {database}"], check=True)
    url = list(urlparse(admin_url))
    url[2] = "/" + database
    server = subprocess.Popen(
        [
            os.path.join(ROOT, "target/debug/idempotencyd"), "serve", "--migrate",
            "--grpc-addr", f"127.0.0.1:{ports['grpc']}",
            "--metrics-addr", f"127.0.0.1:{ports['metrics']}",
        ],
        env={**env, "DATABASE_URL": urlunparse(url)},
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    wait_for_port(ports["grpc"], 60, "idempotencyd")
    return server


def localize(command, ports):
    for readme_port, name in PORTS.items():
        command = re.sub(rf"(127\.0\.0\.1|localhost):{readme_port}\b", rf"\g<1>:{ports[name]}", command)
    return command


def run_session(name, steps, env, ports):
    """Runs the steps in one bash; returns the failures."""
    marker = f"@@readme-step-{uuid.uuid4().hex}@@"
    script = ["set +e"]
    starting = False
    for number, (command, _) in enumerate(steps):
        command = localize(command, ports)
        script.append(f"echo '{marker} {number}'")
        if command.rstrip().endswith("&"):
            # The example's build and start: its output is not the session's.
            script.append(f"( {command.rstrip()[:-1]} ) > /dev/null 2>&1 &")
            starting = True
            continue
        port = re.search(r"(?:127\.0\.0\.1|localhost):(\d+)", command)
        if starting and port:
            # As a reader waits for the example to say it listens.
            script.append(f"python3 '{__file__}' --wait-for-port {port[1]}")
            starting = False
        if not command.lstrip().startswith("#"):  # a comment line runs nothing
            script.append(f"{{ {command}\n}} 2>&1")
    say(f"session {name}: {len(steps)} commands")
    bash = subprocess.Popen(
        ["bash", "-c", "\n".join(script)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        output, _ = bash.communicate(timeout=900)
    finally:
        try:
            os.killpg(bash.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    if os.environ.get("README_CHECK_DEBUG"):
        print("\n".join(script), output, sep="\n----\n", file=sys.stderr)
    printed = {}
    for part in output.split(marker)[1:]:
        number, _, text = part.partition("\n")
        printed[int(number)] = text
    failures = []
    for number, (command, expected) in enumerate(steps):
        text = printed.get(number, "")
        missing = check_output(expected, text)
        if missing is not None:
            failures.append(f"{name}: `$ {command}`\n  expected: {missing}\n  printed:\n{indent(text)}")
    return failures


def indent(text):
    return "\n".join("    " + line for line in text.rstrip().splitlines()) or "    (nothing)"


def self_test():
    """The comparison refuses what differs, so a passing run means something."""
    pretty = '{\n  "acquired": {\n    "fencingToken": "1839315165556525056",\n    "expiresAt": "2026-12-03T10:10:16.362226Z"\n  }\n}\n'
    ok = ['{ "acquired": { "fencingToken": "1", "expiresAt": "2026-11-30T18:15:04.290735Z" } }']
    assert check_output(ok, pretty) is None
    assert check_output(['{ "inProgress": { "retryAfter": "1s" } }'], pretty) is not None
    assert check_output(['{ "acquired": { "fencingToken": "1" } }'], pretty) is not None
    assert check_output(['{ "acquired": { "fencingToken": "x", "expiresAt": "2026-11-30T18:15:04Z" } }'], pretty)
    http = "HTTP/1.1 409 Conflict\nretry-after: 1\n\n{\"detail\":\"busy\",\"status\":409,\"title\":\"x\"}"
    assert check_output(["HTTP/1.1 409 Conflict", "retry-after: 1", '{"detail":"busy",...}'], http) is None
    assert check_output(["HTTP/1.1 201 Created"], http) is not None
    assert check_output(["retry-after: 1", "HTTP/1.1 409 Conflict"], http) is not None, "order"
    assert check_output(['{"detail":"idle",...}'], http) is not None
    timeout = "curl: (28) Operation timed out after 1002 milliseconds with 0 bytes received"
    assert check_output(["curl: (28) Operation timed out after 1001 milliseconds with 0 bytes received"], timeout) is None
    assert check_output(["  Code:  InvalidArgument"], "ERROR:\n  Code:\tInvalidArgument") is None


def main():
    self_test()
    if sys.argv[1:2] == ["--wait-for-port"]:
        wait_for_port(int(sys.argv[2]), 600, "the example")
        return 0
    readme = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "README.md")
    for tool in ("psql", "grpcurl", "jq", "curl"):
        if not shutil.which(tool):
            raise SystemExit(f"check-readme: needs {tool} on PATH")
    if "DATABASE_URL" not in os.environ:
        raise SystemExit("check-readme: needs DATABASE_URL (scripts/with-postgres.sh sets it)")
    ports = {name: free_port() for name in PORTS.values()}
    env = {
        **os.environ,
        "IDEMPOTENCY_ENDPOINT": f"http://127.0.0.1:{ports['grpc']}",
        "PAYMENTS_LISTEN": f"127.0.0.1:{ports['http_example']}",
        "GRPC_PAYMENTS_LISTEN": f"127.0.0.1:{ports['grpc_example']}",
    }
    found = sessions(readme)
    if not found:
        raise SystemExit("check-readme: no `<!-- readme-session: NAME -->` blocks in " + readme)
    with tempfile.NamedTemporaryFile("w+", prefix="readme-server-", suffix=".log") as log:
        server = start_server(env, ports, log)
        try:
            failures = [f for name, steps in found for f in run_session(name, steps, env, ports)]
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        if failures:
            log.seek(0)
            print("\n\n".join(failures), file=sys.stderr)
            print("server log:\n" + indent(log.read()[-4000:]), file=sys.stderr)
            return 1
    say(f"{len(found)} sessions ran as the README shows them: " + ", ".join(name for name, _ in found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
