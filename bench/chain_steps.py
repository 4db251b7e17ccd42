#!/usr/bin/env python3
"""Where one step of sixteen callers in lockstep goes: from a batch request to the next.

At 16 callers the load generator's callers move together: one BatchAcquire of all
sixteen, one Acquire statement, its answer, then one BatchComplete, one Complete
statement, and so on (docs/performance.md, "Sixteen callers in lockstep"). This
reads a system-wide perf recording of such a run and splits each step, from the
load generator's batch request to its next one, at the system calls that mark it:

  server in:    the batch request written (the load generator's sendto of 1 KiB
                or more) to the statement written (the server's next such sendto);
  backend wakes: to the Postgres backend that commits it switched in (0 if it
                was running);
  execute + WAL write: to the backend entering fdatasync for the commit;
  WAL flush:    the fdatasync itself;
  answer sent:  from its end to the backend's sendto of the statement's answer;
  server wakes: to the server's thread that replies switched in (0 if running);
  server out:   to that thread's last write before the next batch request
                (reading the rows, the batch reply);
  client:       to the load generator's next batch request (waking it, handing
                each caller its answer, each caller's next call, the batch).

Only clean steps count: one batch statement and one flush between a request and
the next (a step holding a lone call's statement or a second flush is left out,
and the count says how many were kept).

Record it while 16 callers load the server, with SERVER and LOADGEN their PIDs:

    perf record -a -e sched:sched_switch,syscalls:sys_enter_sendto,\\
syscalls:sys_enter_fdatasync,syscalls:sys_exit_fdatasync -o steps.data -- sleep 0.5
    python3 bench/chain_steps.py steps.data SERVER LOADGEN
"""

import re
import statistics
import subprocess
import sys

BATCH_BYTES = 1024
LINE = re.compile(r"\s*(\S.*?)\s+(\d+)/(\d+)\s+([\d.]+):\s+(\S+):\s*(.*)")
HOPS = (
    "server in",
    "backend wakes",
    "execute + WAL write",
    "WAL flush (fdatasync)",
    "answer sent",
    "server wakes",
    "server out",
    "client (wake + callers + batch)",
    "the whole step",
)


def events(path):
    """(µs, comm, pid, tid, event, bytes written, thread switched in) in time order."""
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
        found.append((
            float(match[4]) * 1e6, match[1], int(match[2]), int(match[3]),
            match[5].split(":")[-1], int(length[1], 16) if length else 0,
            int(switched_in[1]) if switched_in else None,
        ))
    return sorted(found)


def woken(found, begin, end, thread):
    """Where `thread` last switched in between two events (`begin` if it never did)."""
    switches = [k for k in range(begin + 1, end) if found[k][6] == thread]
    return switches[-1] if switches else begin


def steps(found, server, loadgen):
    def sends(pid, least=0):
        return lambda e: e[2] == pid and e[4] == "sys_enter_sendto" and e[5] >= least

    def after(start, matches):
        return next((k for k in range(start, len(found)) if matches(found[k])), None)

    hops = {name: [] for name in HOPS}
    start = after(0, sends(loadgen, BATCH_BYTES))
    while start is not None:
        statement = after(start + 1, sends(server, BATCH_BYTES))
        sync = statement and after(statement + 1, lambda e: e[1] == "postgres" and e[4] == "sys_enter_fdatasync")
        if sync is None:
            break
        backend = found[sync][3]
        synced = after(sync + 1, lambda e: e[3] == backend and e[4] == "sys_exit_fdatasync")
        answer = synced and after(synced + 1, lambda e: e[3] == backend and e[4] == "sys_enter_sendto")
        following = answer and after(answer + 1, sends(loadgen, BATCH_BYTES))
        if following is None:
            break
        replies = [k for k in range(answer + 1, following) if sends(server)(found[k])]
        crowded = any(
            sends(server, BATCH_BYTES)(found[k])
            or (found[k][4] == "sys_enter_fdatasync" and k != sync)
            for k in range(statement + 1, following)
        )
        if replies and not crowded:
            replier = found[replies[-1]][3]
            marks = [
                start, statement, woken(found, statement, sync, backend), sync, synced, answer,
                woken(found, answer, replies[-1], replier), replies[-1], following,
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
        sys.exit(f"{sys.argv[1]}: no clean step found; were 16 callers in lockstep while it recorded?")
    for name, values in hops.items():
        print(
            f"{name:>32}: p50 {statistics.median(values):5.0f} µs, "
            f"mean {statistics.mean(values):5.0f} µs ({len(values)} steps)"
        )


if __name__ == "__main__":
    main()
