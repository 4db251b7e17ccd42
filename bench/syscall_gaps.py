#!/usr/bin/env python3
"""Where a server's time per call goes between its system calls.

Reads a recording of the server's system calls (or of `idempotency-bench
--serve-floor`'s) taken while callers send new-key pairs, and prints, per
statement, the p50 and mean of the intervals below. The recording is either
the output of `perf trace -e sendto,recvfrom,writev -o FILE -p PID`, or a
`perf record -p PID -o FILE -e syscalls:sys_enter_recvfrom,\\
syscalls:sys_exit_recvfrom,syscalls:sys_enter_sendto,syscalls:sys_enter_writev`,
which slows the process far less (at 16 callers `perf trace` added tens of
µs to each interval, and their spread); the script reads the latter with
`perf script`. In it a write ends as it starts.

  arriving: from the first read of the call's request (a `recvfrom` on the
          caller's connection, the first after the reply before) to its last
          (a request the client wrote in several pieces);
  before: from the last read of the call's request to the statement sent to
          Postgres (`sendto`);
  statement: from that `sendto` to the next read of an answer on the same
          connection (the statement, its commit, the round trip and the
          server's wake-up, as the server sees them);
  after:  from that read to the reply written to the caller (the first
          write; `writev` or `sendto`);
  replied: from that read to the last write of the reply (a server that
          writes its trailers apart, as tonic's default stream does, writes
          twice);
  turn:   from the reply's last write to the first read of the next request:
          the caller's own time, as the server sees it.

A step of two kinds of statement (at 16 callers in lockstep: the Acquires'
batch statement, then the Completes') is split with `--kinds-at BYTES`: a
statement of at least BYTES bytes is counted apart from the smaller ones (at
16 calls with 256-byte responses the Complete's is about 6.4 KB, the
Acquire's 2.8 KB: 4000 splits them), and the median of each step's time
outside Postgres is printed: arriving, before, replied and turn of a smaller
statement and of the larger one after it (without `--kinds-at`, of each
statement).

The caller's connection is named with `--caller-fd FD`: the server's socket
whose local port is its gRPC port, as `ss -tnpH "( sport = :PORT )"` shows
it (`fd=FD`). The server writes its replies with `sendto`, as sqlx writes
statements, so the trace alone cannot tell the two apart. Without
`--caller-fd`, a connection the process writes with `writev` is taken as the
caller's (tonic's default stream, as `idempotency-bench --serve-floor` and
servers before 52ddd78 write); every other connection written to is
Postgres's. It also prints how many statements went to each Postgres
connection. A system call that perf shows split over two lines
("[continued]") names no connection and is left out; keep the callers
alone on one connection, so that nothing else (health probes, the gauges'
queries) reads and writes between a request and its reply.

Usage: perf trace ... -o server.trace     (or: perf record ... -o server.data)
       python3 bench/syscall_gaps.py server.trace [--caller-fd FD] [--kinds-at BYTES]
"""

import argparse
import collections
import re
import statistics
import subprocess
import sys

LINE = re.compile(r"^\s*([\d.]+) \(\s*([\d.]+) ms\): \S+ (\w+)\(fd: (\d+).*= (-?\d+)")
# `perf script` of the tracepoints: "comm tid [cpu] seconds: syscalls:sys_enter_sendto: fd: 0x.., ..."
TRACEPOINT = re.compile(r"^\s*\S.*?\s(\d+)\s+\[\d+\]\s+([\d.]+):\s+syscalls:sys_(enter|exit)_(\w+):\s*(.*)")


def events(path):
    """(start µs, end µs, call, fd, result) of each traced system call, from
    `perf trace -o` output or a `perf record` of the system calls'
    tracepoints (read with `perf script`)."""
    with open(path, "rb") as file:
        recorded = file.read(8) == b"PERFILE2"
    if recorded:
        script = subprocess.run(["perf", "script", "-i", path], capture_output=True, text=True, check=True)
        yield from tracepoint_events(script.stdout.splitlines())
        return
    with open(path) as trace:
        for line in trace:
            match = LINE.match(line)
            if match:
                start = float(match[1]) * 1000
                yield start, start + float(match[2]) * 1000, match[3], int(match[4]), int(match[5])


def tracepoint_events(lines):
    """Events from the tracepoints sys_enter_recvfrom and sys_exit_recvfrom
    (a read starts and ends), sys_enter_sendto and sys_enter_writev (a write
    counts from its start: it ends at once here; a sendto's result is its
    length, a writev's is 1)."""
    reading = {}  # thread -> (start, fd) of its read under way
    for line in lines:
        match = TRACEPOINT.match(line)
        if not match:
            continue
        thread, at, edge, call, fields = match[1], float(match[2]) * 1e6, match[3], match[4], match[5]
        if edge == "enter":
            fd = re.search(r"\bfd: (0x[0-9a-f]+)", fields)
            if fd is None:
                continue
            fd = int(fd[1], 16)
            if call == "recvfrom":
                reading[thread] = (at, fd)
            elif call == "sendto":
                length = re.search(r"\blen: (0x[0-9a-f]+)", fields)
                yield at, at, call, fd, int(length[1], 16) if length else 1
            elif call == "writev":
                yield at, at, call, fd, 1
        elif call == "recvfrom" and thread in reading:
            start, fd = reading.pop(thread)
            result = int(re.findall(r"0x[0-9a-f]+", fields)[-1], 16)
            if result >= 1 << 63:
                result -= 1 << 64
            yield start, at, call, fd, result


INTERVALS = ("arriving", "before", "statement", "after", "replied", "turn")


OUTSIDE = ("arriving", "before", "replied", "turn")


def gaps(path, caller_fds=(), kinds_at=None):
    """Each statement's intervals, in the order they ran (a dict per
    statement: its kind, by its size against `kinds_at`, and each interval
    measured), and the statements per Postgres connection."""
    calls = list(events(path))
    callers = set(caller_fds) or {fd for _, _, call, fd, _ in calls if call == "writev"}
    if not callers:
        sys.exit(
            f"{path}: which connection is the caller's? The server writes its replies with "
            "sendto, as it writes statements: name it with --caller-fd FD "
            '(ss -tnpH "( sport = :PORT )" shows fd=FD for the gRPC port PORT)'
        )
    ran = []
    statements = collections.Counter()
    first = request = sent = answered = answered_at = None
    replying = None  # the statement whose reply is being written: (its record, its last write)
    database = None  # the connection the statement went to
    for start, end, call, fd, result in calls:
        if call == "recvfrom" and fd in callers and result > 0:
            if replying is not None:
                record, last_write = replying
                record["replied"] = last_write - answered_at
                record["turn"] = start - last_write
                replying = None
            if first is None:
                first = start
            request = end
        elif call == "sendto" and fd not in callers and request is not None:
            kind = "all" if kinds_at is None else (f">= {kinds_at} B" if result >= kinds_at else f"< {kinds_at} B")
            ran.append({"kind": kind, "arriving": request - first, "before": start - request})
            statements[fd] += 1
            sent, database, first, request = end, fd, None, None
        elif call == "recvfrom" and fd == database and result > 0 and sent is not None:
            ran[-1]["statement"] = end - sent
            answered, sent = end, None
        elif call in ("writev", "sendto") and fd in callers and answered is not None:
            ran[-1]["after"] = start - answered
            answered_at, answered = answered, None
            replying = (ran[-1], start)
            first = request = None  # the next request's first read comes after this
        elif call in ("writev", "sendto") and fd in callers and replying is not None:
            replying = (replying[0], start)
    return ran, statements


def outside_per_step(ran, kinds_at):
    """Each step's time outside Postgres: a statement's, or, with two kinds,
    a smaller statement's and the larger one's after it (an Acquire's and its
    Complete's, at 16 callers in lockstep)."""
    whole = [r for r in ran if all(name in r for name in OUTSIDE)]
    totals = {id(r): sum(r[name] for name in OUTSIDE) for r in whole}
    if kinds_at is None:
        return list(totals.values())
    return [
        totals[id(a)] + totals[id(b)]
        for a, b in zip(ran, ran[1:])
        if a["kind"].startswith("<") and b["kind"].startswith(">=") and id(a) in totals and id(b) in totals
    ]


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0], epilog="See the module's docstring for each interval."
    )
    parser.add_argument("trace", help="perf trace -e sendto,recvfrom,writev -o FILE -p PID, or a perf record of the tracepoints")
    parser.add_argument(
        "--caller-fd", type=int, action="append", default=[], metavar="FD",
        help="the server's file descriptor of the caller's connection (repeatable)",
    )
    parser.add_argument(
        "--kinds-at", type=int, metavar="BYTES",
        help="count statements of at least BYTES bytes apart from the smaller ones",
    )
    args = parser.parse_args()
    ran, statements = gaps(args.trace, args.caller_fd, args.kinds_at)
    if not ran:
        sys.exit(f"{args.trace}: no statements found; is it a perf trace of the server?")
    for kind in sorted({r["kind"] for r in ran}):
        print(f"statements: {kind}")
        for name in INTERVALS:
            values = [r[name] for r in ran if r["kind"] == kind and name in r]
            if not values:
                print(f"{name:>10}: none measured")
                continue
            print(
                f"{name:>10}: p50 {statistics.median(values):6.1f} µs, "
                f"mean {statistics.mean(values):6.1f} µs ({len(values)} statements)"
            )
    steps = outside_per_step(ran, args.kinds_at)
    if steps:
        what = "step (a smaller statement and the larger after it)" if args.kinds_at else "statement"
        print(
            f"outside Postgres (arriving + before + replied + turn), per {what}: "
            f"p50 {statistics.median(steps):6.1f} µs, mean {statistics.mean(steps):6.1f} µs ({len(steps)})"
        )
    print("statements per Postgres connection (fd):", dict(statements))


if __name__ == "__main__":
    main()
