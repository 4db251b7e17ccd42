#!/usr/bin/env python3
"""Where one step of sixteen callers in lockstep goes: from a batch request to the next.

At 16 callers the load generator's callers move together: one BatchAcquire of all
sixteen, one Acquire statement, its answer, then one BatchComplete, one Complete
statement, and so on (docs/performance.md, "Sixteen callers in lockstep"). This
reads a system-wide perf recording of such a run and splits each step, from the
load generator's batch request to its next one, at the system calls that mark it:

  to the server:  the batch request written (the load generator's sendto of
                  1 KiB or more) to the server's thread running (the send, the
                  wake-up; 0 if it was running);
  server in:      to the statement written (the server's next sendto of 1 KiB or
                  more to a connection other than the caller's);
  to the backend: to the Postgres backend that commits it running;
  execute + WAL write: to the backend entering fdatasync for the commit;
  WAL flush:      the fdatasync itself;
  answer sent:    from its end to the backend's sendto of the statement's answer;
  to the server:  to the server's thread that replies running;
  server out:     to its last write to the caller before the next batch request
                  (reading the rows, the batch reply);
  to the client:  to the load generator's thread that sends the next request
                  running;
  client:         to that request written (handing each caller its answer, each
                  caller's next call, the batch).

Each "to" hop ends at the thread's first switch-in after the hop began. The
caller's connection is the one the server writes to last before each batch
request (the most common such descriptor). The hops are medians each: their
sum is near the whole step's median, not equal to it.

Only clean steps count: one batch statement and one flush between a request and
the next (a step holding a lone call's statement or a second flush is left out,
and the count says how many were kept).

Record it while 16 callers load the server, with SERVER and LOADGEN their PIDs:

    perf record -a -e sched:sched_switch,syscalls:sys_enter_sendto,\\
syscalls:sys_enter_fdatasync,syscalls:sys_exit_fdatasync -o steps.data -- sleep 0.5
    python3 bench/chain_steps.py steps.data SERVER LOADGEN
"""

import collections
import re
import statistics
import subprocess
import sys

BATCH_BYTES = 1024
LINE = re.compile(r"\s*(\S.*?)\s+(\d+)/(\d+)\s+([\d.]+):\s+(\S+):\s*(.*)")
HOPS = (
    "to the server",
    "server in",
    "to the backend",
    "execute + WAL write",
    "WAL flush (fdatasync)",
    "answer sent",
    "to the server again",
    "server out",
    "to the client",
    "client",
    "the whole step",
)


def events(path):
    """(µs, comm, pid, tid, event, bytes written, thread switched in, fd) in time order."""
    script = subprocess.run(
        ["perf", "script", "-i", path, "-F", "comm,pid,tid,time,event,trace"],
        capture_output=True, text=True, check=True,
    ).stdout
    found = []
    for line in script.splitlines():
        match = LINE.match(line)
        if not match:
            continue
        length = re.search(r"len: 0x([0-9a-f]+)", match[6])
        switched_in = re.search(r"next_pid=(\d+)", match[6])
        fd = re.search(r"fd: 0x([0-9a-f]+)", match[6])
        found.append((
            float(match[4]) * 1e6, match[1], int(match[2]), int(match[3]),
            match[5].split(":")[-1], int(length[1], 16) if length else 0,
            int(switched_in[1]) if switched_in else None,
            int(fd[1], 16) if fd else None,
        ))
    return sorted(found)


def woken(found, begin, end, thread):
    """Where `thread` first switched in after `begin`, before `end` (`begin` if
    it never did: it was running)."""
    return next((k for k in range(begin + 1, end) if found[k][6] == thread), begin)


def caller_fd(found, server, loadgen):
    """The server's descriptor for the caller: the one it writes to last
    before each of the load generator's batch requests, most often."""
    last = collections.Counter()
    write = None
    for event in found:
        if event[2] == server and event[4] == "sys_enter_sendto":
            write = event[7]
        elif event[2] == loadgen and event[4] == "sys_enter_sendto" and event[5] >= BATCH_BYTES:
            if write is not None:
                last[write] += 1
    return last.most_common(1)[0][0] if last else None


def steps(found, server, loadgen):
    caller = caller_fd(found, server, loadgen)

    def after(start, matches):
        return next((k for k in range(start, len(found)) if matches(found[k])), None)

    def request(e):
        return e[2] == loadgen and e[4] == "sys_enter_sendto" and e[5] >= BATCH_BYTES

    def statement_sent(e):
        return (
            e[2] == server and e[4] == "sys_enter_sendto" and e[5] >= BATCH_BYTES and e[7] != caller
        )

    def reply_sent(e):
        return e[2] == server and e[4] == "sys_enter_sendto" and e[7] == caller

    def flush(e):
        return e[1] == "postgres" and e[4] == "sys_enter_fdatasync"

    hops = {name: [] for name in HOPS}
    start = after(0, request)
    while start is not None:
        statement = after(start + 1, statement_sent)
        sync = None if statement is None else after(statement + 1, flush)
        if sync is None:
            break
        backend = found[sync][3]
        synced = after(sync + 1, lambda e: e[3] == backend and e[4] == "sys_exit_fdatasync")
        answer = None if synced is None else after(
            synced + 1, lambda e: e[3] == backend and e[4] == "sys_enter_sendto"
        )
        following = None if answer is None else after(answer + 1, request)
        if following is None:
            break
        replies = [k for k in range(answer + 1, following) if reply_sent(found[k])]
        crowded = any(
            statement_sent(found[k]) or (flush(found[k]) and k != sync)
            for k in range(statement + 1, following)
        )
        if replies and not crowded:
            reply = replies[-1]
            marks = [
                start, woken(found, start, statement, found[statement][3]), statement,
                woken(found, statement, sync, backend), sync, synced, answer,
                woken(found, answer, reply, found[reply][3]), reply,
                woken(found, reply, following, found[following][3]), following,
            ]
            times = [found[k][0] for k in marks]
            for name, begin, end in zip(HOPS, times, times[1:]):
                hops[name].append(end - begin)
            hops["the whole step"].append(times[-1] - times[0])
        start = following
    return hops


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    hops = steps(events(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
    if not hops["the whole step"]:
        sys.exit(
            f"{sys.argv[1]}: no clean step found; were 16 callers in lockstep while it recorded?"
        )
    for name, values in hops.items():
        print(
            f"{name:>32}: p50 {statistics.median(values):5.0f} µs, "
            f"mean {statistics.mean(values):5.0f} µs ({len(values)} steps)"
        )


if __name__ == "__main__":
    main()
