#!/usr/bin/env python3
"""scripts/bench-budget.sh's table: a new-key pair's time, hop by hop, for
pgbench and the service. Standard library only.

  budget_report.py C WORK PG_INSERT PG_UPDATE PG_WAL SV_ACQUIRE SV_FINISH SV_WAL
  budget_report.py --floors C WORK PG_SELECT PG_SHAPE SV_REPLAY SV_READ
  budget_report.py --pairs C WORK
  budget_report.py --driver WORK

Statement figures are "calls|exec ms|plan ms", WAL figures "flushes|flush ms".
The second form prints the round trips with nothing behind them and the
replays through Postgres, the third new-key pairs against the floor
(idempotency-bench --serve-floor) beside the server's and pgbench's, the
fourth pgbench's pair and primary-key SELECT through sqlx alone
(idempotency-bench --driver-floor) beside pgbench's.
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


def us(x):
    """Microseconds as the tables print them; "-" for none."""
    return "-" if x is None else f"{x:,.0f}"


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
    paused = f"{work}/pgbench-paused.out"
    try:
        out = open(paused).read()
        flushes, flush_ms = fields(open(f"{work}/pgbench-paused.wal").read().strip())
        stmt = [float(x) * 1000 for x in
                re.findall(r"^\s+([0-9.]+)\s+\d+\s+(?:INSERT|UPDATE)", out, re.M)]
        pause = re.findall(r"^\s+[0-9.]+\s+\d+\s+\\sleep (\d+) us", out, re.M)
        print(f"pgbench's pair with a {pause[0] if pause else '?'} µs pause before each statement: "
              f"INSERT / UPDATE {us(stmt[0])} / {us(stmt[1])} µs (without: {us(latency[0])} / "
              f"{us(latency[1])}); WAL flushes {flush_ms / flushes * 1000 if flushes else 0:,.0f} µs each "
              f"(without: {us(pg_flush)})")
    except FileNotFoundError:
        pass
    print(f"CPU per pair: server {service['server_cpu_seconds'] * 1e6 / pairs:,.0f} µs, load generator "
          f"{service['client_cpu_seconds'] * 1e6 / pairs:,.0f} µs; machine busy {service['machine_cpu_busy']}")


def floors(argv):
    c, work = int(argv[1]), argv[2]
    pg_select, pg_shape, sv_replay, sv_read = map(fields, argv[3:7])

    def number(name):
        return float(open(f"{work}/{name}").read())

    def report(name):
        return json.load(open(f"{work}/{name}"))

    def row(label, mean, p50=None, rate=None):
        print(f"| {label} | {us(mean)} | {us(p50)} | {'-' if rate is None else f'{rate:,.0f}'} |")

    print(f"\n{c} callers: round trips with nothing behind them (µs per call)")
    print()
    print("| round trip | mean | p50 | calls/s |")
    print("|---|---:|---:|---:|")
    row("pgbench `SELECT 1` (to Postgres and back)", number("floor-pg.txt"))
    for label, name in [("gRPC health Check, tonic alone", "floor-bare.json"),
                        ("gRPC health Check, the server", "floor-health.json"),
                        ("Acquire replayed from the server's cache", "floor-cached.json")]:
        r = report(name)
        row(label, r["latency_us"]["mean"], r["latency_us"]["p50"], r["ops_per_sec"])

    service = report("replay-service.json")
    before, after = prometheus(f"{work}/before.prom"), prometheus(f"{work}/after.prom")
    req, calls = mean_us(before, after, "idempotency_request_duration_seconds",
                     '{rpc="Acquire",outcome="completed"}')
    st, n = mean_us(before, after, "idempotency_db_query_duration_seconds", '{query="acquire"}')
    call = service["latency_us"]["mean"]
    select_call, shape_call = number("replay-pg.txt"), number("replay-shape.txt")
    print(f"\n{c} callers: a replay through Postgres (µs per call, mean; the service's p50 "
          f"{service['latency_us']['p50']:,}, {service['ops_per_sec']:,.0f}/s, "
          f"{calls / n if n else 0:.1f} calls per statement)")
    print()
    print("| per call, µs (mean) | pgbench, primary-key SELECT | pgbench, the service's Acquire statement | the service |")
    print("|---|---:|---:|---:|")
    print(f"| the call at the caller | {us(select_call)} | {us(shape_call)} | {us(call)} |")
    print(f"| outside the server (client library, gRPC, wake-ups) | - | - | {us(call - req if req else None)} |")
    print(f"| in the server, not in its statement | - | - | {us(req - st if req and st else None)} |")
    print(f"| the statement, commit included | {us(select_call)} | {us(shape_call)} | {us(st)} |")
    # A replay alone is the insert that finds the key and then the read
    # (inserting first), one statement that reads first (matched as an
    # insert: it holds one), or the plain read alone (once most keys
    # exist): their execution per replay, each replay counted once.
    replays = max(sv_replay[0], sv_read[0])
    replay_exec = ((sv_replay[1] + sv_read[1]) / replays * 1000) if replays else None
    print(f"| of which Postgres execution | {us(per_call(pg_select)[0])} | {us(per_call(pg_shape)[0])} "
          f"| {us(replay_exec)} |")


def pairs(argv):
    c, work = int(argv[1]), argv[2]

    def report(name):
        return json.load(open(f"{work}/pair-{name}.json"))

    pg = float(open(f"{work}/pair-pg.txt").read())
    print(f"\n{c} callers: new-key pairs against the floor (pgbench's two statements behind tonic alone)")
    print()
    print("| pair (Acquire + Complete) | pairs/s | mean µs | p50 µs | over pgbench, mean µs | server CPU µs per pair |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| pgbench | {c * 1e6 / pg:,.0f} | {us(pg)} | - | - | - |")
    for label, name in [("the floor, generated stub", "floor-stub"),
                        ("the floor, client library", "floor-library"),
                        ("the server, generated stub", "server-stub"),
                        ("the server, client library", "server-library")]:
        r = report(name)
        cpu = r.get("server_cpu_seconds")
        cpu = cpu * 1e6 / r["ops"] if cpu is not None and r["ops"] else None
        mean = r["latency_us"]["mean"]
        print(f"| {label} | {r['ops_per_sec']:,.0f} | {us(mean)} | {us(r['latency_us']['p50'])} "
              f"| {us(mean - pg)} | {us(cpu)} |")


def driver(argv):
    work = argv[1]
    pg = {"pair": float(open(f"{work}/pair-pg.txt").read()),
          "select": float(open(f"{work}/replay-pg.txt").read())}
    print("\n1 callers: pgbench's statements through sqlx alone (one connection, one at a time)")
    print()
    print("| µs | pgbench, mean | sqlx alone, mean | sqlx alone, p50 |")
    print("|---|---:|---:|---:|")
    for label, name in [("the new-key pair", "pair"), ("the primary-key SELECT", "select")]:
        r = json.load(open(f"{work}/driver-{name}.json"))
        print(f"| {label} | {us(pg[name])} | {us(r['latency_us']['mean'])} | {us(r['latency_us']['p50'])} |")


if __name__ == "__main__":
    if sys.argv[1] == "--driver":
        driver(sys.argv[1:])
    elif sys.argv[1] == "--floors":
        floors(sys.argv[1:])
    elif sys.argv[1] == "--pairs":
        pairs(sys.argv[1:])
    else:
        main(sys.argv)
