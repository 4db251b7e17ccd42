#!/usr/bin/env python3
"""Where a server's time per call goes between its system calls, at one caller.

Reads the output of `perf trace -e sendto,recvfrom,writev -o FILE -p PID`
taken of the server (or of `idempotency-bench --serve-floor`) while one
caller sends new-key pairs, and prints, per statement, the p50 and mean of:

  before: from the last read of the call's request (a `recvfrom` on the
          caller's connection) to the statement sent to Postgres (`sendto`);
  statement: from that `sendto` to the next read of an answer on the same
          connection (the statement, its commit, the round trip and the
          server's wake-up, as the server sees them);
  after:  from that read to the reply written to the caller (`writev`).

The caller's connection is named with `--caller-fd FD`: the server's socket
whose local port is its gRPC port, as `ss -tnpH "( sport = :PORT )"` shows
it (`fd=FD`). The server writes its replies with `sendto`, as sqlx writes
statements, so the trace alone cannot tell the two apart. Without
`--caller-fd`, a connection the process writes with `writev` is taken as the
caller's (tonic's default stream, as `idempotency-bench --serve-floor` and
servers before 52ddd78 write); every other connection written to is
Postgres's. It also prints how many statements went to each Postgres
connection. A system call that perf shows split over two lines
("[continued]") names no connection and is left out; keep the caller alone,
so that nothing else (health probes, the gauges' queries) reads and writes
between a request and its reply.

Usage: perf trace ... -o server.trace
       python3 bench/syscall_gaps.py server.trace [--caller-fd FD]
"""

import argparse
import collections
import re
import statistics
import sys

LINE = re.compile(r"^\s*([\d.]+) \(\s*([\d.]+) ms\): \S+ (\w+)\(fd: (\d+).*= (-?\d+)")


def events(path):
    """(start µs, end µs, call, fd, result) of each traced system call."""
    with open(path) as trace:
        for line in trace:
            match = LINE.match(line)
            if match:
                start = float(match[1]) * 1000
                yield start, start + float(match[2]) * 1000, match[3], int(match[4]), int(match[5])


def gaps(path, caller_fds=()):
    calls = list(events(path))
    callers = set(caller_fds) or {fd for _, _, call, fd, _ in calls if call == "writev"}
    if not callers:
        sys.exit(
            f"{path}: which connection is the caller's? The server writes its replies with "
            "sendto, as it writes statements: name it with --caller-fd FD "
            '(ss -tnpH "( sport = :PORT )" shows fd=FD for the gRPC port PORT)'
        )
    before, statement, after = [], [], []
    statements = collections.Counter()
    request = sent = answered = None
    database = None  # the connection the statement went to
    for start, end, call, fd, result in calls:
        if call == "recvfrom" and fd in callers and result > 0:
            request = end
        elif call == "sendto" and fd not in callers and request is not None:
            before.append(start - request)
            statements[fd] += 1
            sent, database, request = end, fd, None
        elif call == "recvfrom" and fd == database and result > 0 and sent is not None:
            statement.append(end - sent)
            answered, sent = end, None
        elif call in ("writev", "sendto") and fd in callers and answered is not None:
            after.append(start - answered)
            answered = None
    return {"before": before, "statement": statement, "after": after}, statements


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0], epilog="See the module's docstring for each interval."
    )
    parser.add_argument("trace", help="the output of perf trace -e sendto,recvfrom,writev -o FILE -p PID")
    parser.add_argument(
        "--caller-fd", type=int, action="append", default=[], metavar="FD",
        help="the server's file descriptor of the caller's connection (repeatable)",
    )
    args = parser.parse_args()
    spans, statements = gaps(args.trace, args.caller_fd)
    for name, values in spans.items():
        if not values:
            sys.exit(f"{args.trace}: no {name} intervals found; is it a perf trace of the server?")
        print(
            f"{name:>9}: p50 {statistics.median(values):6.1f} µs, "
            f"mean {statistics.mean(values):6.1f} µs ({len(values)} statements)"
        )
    print("statements per Postgres connection (fd):", dict(statements))


if __name__ == "__main__":
    main()
