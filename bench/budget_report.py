#!/usr/bin/env python3
"""scripts/bench-budget.sh's table: a new-key pair's time, hop by hop, for
pgbench and the service. Standard library only.

  budget_report.py C WORK PG_INSERT PG_UPDATE PG_WAL SV_ACQUIRE SV_FINISH SV_WAL

Statement figures are "calls|exec ms|plan ms", WAL figures "flushes|flush ms".
"""

import json
import re
import sys


def fields(text):
    return [float(x) for x in text.split("|")]


def prometheus(path):
    values = {}
    for line in open(path):
        if line.startswith("#"):
            continue
        m = re.match(r"(\S+?)(\{.*\})? (\S+)$", line.strip())
        if m:
            values[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return values


def mean_us(before, after, name, labels):
    """The mean of a histogram over the run, in µs, and its count."""
    total = after.get((name + "_sum", labels), 0) - before.get((name + "_sum", labels), 0)
    count = after.get((name + "_count", labels), 0) - before.get((name + "_count", labels), 0)
    return (total / count * 1e6 if count else None), count


def per_call(stats):
    calls, exec_ms, plan_ms = stats
    return (exec_ms / calls * 1000, plan_ms / calls * 1000) if calls else (None, None)


def main(argv):
    c, work = int(argv[1]), argv[2]
    pg_insert, pg_update, pg_wal, sv_acquire, sv_finish, sv_wal = map(fields, argv[3:9])
    out = open(f"{work}/pgbench.out").read()
    tps = float(re.search(r"tps = ([0-9.]+)", out).group(1))
    latency = [float(x) * 1000 for x in
               re.findall(r"^\s+([0-9.]+)\s+\d+\s+(?:INSERT|UPDATE)", out, re.M)]
    service = json.load(open(f"{work}/service.json"))
    before, after = prometheus(f"{work}/before.prom"), prometheus(f"{work}/after.prom")
    request = "idempotency_request_duration_seconds"
    query = "idempotency_db_query_duration_seconds"
    req_acquire, _ = mean_us(before, after, request, '{rpc="Acquire",outcome="acquired"}')
    req_complete, _ = mean_us(before, after, request, '{rpc="Complete",outcome="ok"}')
    st_acquire, n_acquire = mean_us(before, after, query, '{query="acquire"}')
    st_finish, n_finish = mean_us(before, after, query, '{query="finish"}')
    pairs = service["ops"]
    acquire_mean = service["acquire_latency_us"]["mean"]
    complete_mean = service["latency_us"]["mean"] - acquire_mean
    pi, pu = per_call(pg_insert), per_call(pg_update)
    si, su = per_call(sv_acquire), per_call(sv_finish)

    def us(x):
        return "-" if x is None else f"{x:,.0f}"

    print(f"\n{c} callers: pgbench {tps:,.0f} pairs/s; the service {service['ops_per_sec']:,.0f} "
          f"pairs/s, pair p50 {service['latency_us']['p50']:,} µs (mean {service['latency_us']['mean']:,.0f}), "
          f"Acquire p50 {service['acquire_latency_us']['p50']:,} µs")
    print()
    print("| per call, µs (mean) | pgbench INSERT / UPDATE | service Acquire / Complete |")
    print("|---|---:|---:|")
    print(f"| the call at the caller | {us(latency[0])} / {us(latency[1])} | {us(acquire_mean)} / {us(complete_mean)} |")
    print(f"| outside the server (client library, gRPC, wake-ups) | - | "
          f"{us(acquire_mean - req_acquire)} / {us(complete_mean - req_complete)} |")
    print(f"| in the server, not in its statement (queue, rules, reply) | - | "
          f"{us(req_acquire - st_acquire)} / {us(req_complete - st_finish)} |")
    print(f"| the statement, commit included | {us(latency[0])} / {us(latency[1])} | {us(st_acquire)} / {us(st_finish)} |")
    print(f"| of which Postgres execution | {us(pi[0])} / {us(pu[0])} | {us(si[0])} / {us(su[0])} |")
    print(f"| of which planning | {us(pi[1])} / {us(pu[1])} | {us(si[1])} / {us(su[1])} |")
    pg_flush = pg_wal[1] / pg_wal[0] * 1000 if pg_wal[0] else None
    sv_flush = sv_wal[1] / sv_wal[0] * 1000 if sv_wal[0] else None
    print()
    print(f"calls per statement: {pairs / n_acquire if n_acquire else 0:.1f} Acquire, "
          f"{pairs / n_finish if n_finish else 0:.1f} Complete; "
          f"WAL flushes: pgbench {pg_wal[0] / pg_insert[0] if pg_insert[0] else 0:.2f} per pair, "
          f"{us(pg_flush)} µs each; the service {sv_wal[0] / pairs if pairs else 0:.2f} per pair, "
          f"{us(sv_flush)} µs each")
    print(f"CPU per pair: server {service['server_cpu_seconds'] * 1e6 / pairs:,.0f} µs, load generator "
          f"{service['client_cpu_seconds'] * 1e6 / pairs:,.0f} µs; machine busy {service['machine_cpu_busy']}")


if __name__ == "__main__":
    main(sys.argv)
