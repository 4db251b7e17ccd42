#!/usr/bin/env python3
"""Helpers of scripts/bench.sh: CPU accounting, one JSON line per measurement,
and the summary (medians, table, results file). Standard library only.

  report.py ticks POSTMASTER_PID SERVER_PID SHELL_PID
  report.py pgbench SCENARIO C REP PREFIX BEFORE AFTER WAL_BYTES [CLIENTS KEYS]  >> raw.jsonl
  report.py service SCENARIO C REP JSON BEFORE AFTER WAL_BYTES VMHWM [IN_FLIGHT] >> raw.jsonl
  report.py progress RAW
  report.py other BEFORE AFTER
  report.py summary RAW OUT_PREFIX META_JSON
"""

import glob
import json
import os
import platform
import re
import statistics
import sys
import urllib.request


def proc_times(pid):
    """utime, stime, cutime, cstime (ticks) and the parent of a process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    rest = stat[stat.rindex(")") + 2 :].split()
    # rest[0] is field 3 (state): field n is rest[n - 3].
    return int(rest[1]), sum(int(x) for x in rest[11:15])


def ticks(postmaster, server, shell):
    """'busy total ours': machine CPU ticks, and those of this benchmark's
    processes (Postgres and its exited backends, the server, and everything
    this script ran and reaped: pgbench, the load generator, psql)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    total = sum(fields)
    busy = total - fields[3] - fields[4]  # less idle and iowait
    ours = 0
    for pid in (postmaster, server, shell):
        t = proc_times(pid)
        ours += t[1] if t else 0
    for path in glob.glob("/proc/[0-9]*/stat"):
        pid = path.split("/")[2]
        t = proc_times(pid)
        if t and str(t[0]) == str(postmaster):
            ours += t[1]
    return busy, total, ours


def cpu_fractions(before, after):
    """(machine busy, busy with other work) as fractions of all cores."""
    b0, t0, o0 = map(int, before.split())
    b1, t1, o1 = map(int, after.split())
    if t1 <= t0:
        return None, None
    busy = (b1 - b0) / (t1 - t0)
    other = max(0.0, ((b1 - b0) - (o1 - o0)) / (t1 - t0))
    return round(busy, 3), round(other, 3)


def pgbench_record(scenario, c, rep, prefix, before, after, wal, clients=None, keys=1):
    """One pgbench run. `keys`: keys per transaction (the ceiling's
    multi-row statements), so that keys/s = transactions/s x keys."""
    out = open(prefix + ".out").read()
    tps = float(re.search(r"tps = ([0-9.]+) \(without initial connection time\)", out).group(1))
    processed = int(re.search(r"number of transactions actually processed: (\d+)", out).group(1))
    failed = re.search(r"number of failed transactions: (\d+)", out)
    lat = []
    for path in glob.glob(prefix + ".[0-9]*"):
        with open(path) as f:
            for line in f:
                # client_id transaction_no time_us script_no epoch epoch_us;
                # time_us is the whole script: both statements of a pair.
                fields = line.split()
                if len(fields) >= 3 and fields[2].isdigit():
                    lat.append(int(fields[2]))
    lat.sort()

    def q(p):
        return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else None

    busy, other = cpu_fractions(before, after)
    return {
        "tool": "pgbench", "scenario": scenario, "concurrency": int(c), "rep": int(rep),
        "clients": int(clients or c), "keys_per_op": int(keys),
        "ops_per_sec": tps, "ops": processed, "keys_per_sec": tps * int(keys),
        "errors_total": int(failed.group(1)) if failed else 0,
        "latency_us": {"p50": q(0.50), "p90": q(0.90), "p99": q(0.99), "p999": q(0.999),
                       "max": lat[-1] if lat else None},
        "machine_cpu_busy": busy, "other_cpu_busy": other,
        "wal_bytes": int(wal),
        "wal_bytes_per_op": round(int(wal) / processed) if processed else None,
    }


def statement_counts(metrics_port):
    """The server's running count of batch statements and the calls they held,
    per kind (`idempotency_db_batch_size`), as "kind:calls:statements,...";
    empty if its metrics cannot be read."""
    try:
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        page = urllib.request.urlopen(url, timeout=2).read().decode()
    except (OSError, ValueError):
        return ""
    counts = {}
    for line in page.splitlines():
        m = re.match(r'idempotency_db_batch_size_(sum|count)\{query="(\w+)"\} (\S+)', line)
        if m:
            counts.setdefault(m[2], {})[m[1]] = float(m[3])
    return ",".join(f"{k}:{v.get('sum', 0):.0f}:{v.get('count', 0):.0f}" for k, v in counts.items())


def parse_statement_counts(text):
    """`statement_counts`' text back as {kind: (calls, statements)}."""
    return {k: (float(a), float(b)) for k, a, b in
            (item.split(":") for item in (text or "").split(",") if item)}


def calls_per_statement(before, after):
    """Calls per batch statement of each kind between two `statement_counts`:
    at 16 callers this tells whether the callers moved as one group (16.0) or
    split into groups that take turns (about 8)."""
    b, a = parse_statement_counts(before), parse_statement_counts(after)
    per = {}
    for kind, (calls, statements) in a.items():
        calls0, statements0 = b.get(kind, (0.0, 0.0))
        if statements > statements0:
            per[kind] = round((calls - calls0) / (statements - statements0), 2)
    return per or None


def service_record(scenario, c, rep, path, before, after, wal, vmhwm, in_flight_peak="",
                   statements_before="", statements_after=""):
    r = json.load(open(path))
    # WAL and the other load were sampled around the whole invocation, warm-up
    # included; the load generator's own CPU figures cover the timed part only.
    calls = r["ops"] + r["warmup_ops"] + r["errors_total"]
    _, other = cpu_fractions(before, after)
    r.update({
        "tool": "service", "scenario": scenario, "concurrency": int(c), "rep": int(rep),
        "other_cpu_busy": other, "server_vmhwm_kb": int(vmhwm), "wal_bytes": int(wal),
        "server_in_flight_peak": int(in_flight_peak) if in_flight_peak not in (None, "") else None,
        # Warm-up included, as the WAL.
        "server_calls_per_statement": calls_per_statement(statements_before, statements_after),
        "wal_bytes_per_op": round(int(wal) / calls) if calls else None,
    })
    return r


def progress(raw):
    r = json.loads(open(raw).read().splitlines()[-1])
    lat = r["latency_us"]
    line = "bench:   %-8s %-16s c=%-3d rep %d: %9.1f/s  p50 %6.2f ms  p99 %6.2f ms  other load %3.0f %%" % (
        r["tool"], r["scenario"], r["concurrency"], r["rep"], r["ops_per_sec"],
        (lat["p50"] or 0) / 1000, (lat["p99"] or 0) / 1000, 100 * (r.get("other_cpu_busy") or 0))
    if r.get("keys_per_op", 1) > 1:
        line += "  (%d keys each: %.0f keys/s)" % (r["keys_per_op"], r["keys_per_sec"])
    if r.get("server_in_flight_peak") is not None:
        line += "  in flight at most %d, peak RSS %.1f MiB" % (
            r["server_in_flight_peak"], r["server_vmhwm_kb"] / 1024)
    per_statement = r.get("server_calls_per_statement") or {}
    if r["scenario"] == "new-keys" and per_statement.get("acquire"):
        line += "  %.1f calls per Acquire statement" % per_statement["acquire"]
    if r.get("errors_total"):
        line += "  errors %d" % r["errors_total"]
    print(line, file=sys.stderr)


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def idle_wakeup():
    """How an idle CPU waits, which sets what waking it costs. On a virtual
    machine whose idle vCPUs halt at once (cpuidle's haltpoll driver with
    guest_halt_poll_ns 0), every hand-off to a sleeping process pays the
    hypervisor's wake-up, about 30 µs here: docs/performance.md, "Waking a
    halted vCPU"."""
    def read(path):
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return None
    driver = read("/sys/devices/system/cpu/cpuidle/current_driver")
    poll_ns = read("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
    return {"cpuidle_driver": driver,
            "guest_halt_poll_ns": int(poll_ns) if poll_ns and poll_ns.isdigit() else None}


def idle_wakeup_text(idle):
    if idle["cpuidle_driver"] is None:
        return "cpuidle driver unknown"
    text = f"cpuidle {idle['cpuidle_driver']}"
    if idle["guest_halt_poll_ns"] is not None:
        text += f", guest_halt_poll_ns {idle['guest_halt_poll_ns']}"
    return text


def mem_gib():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1048576, 1)
    return None


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# Service scenarios measured against another scenario's pgbench runs.
PGBENCH_SCENARIO = {"replay-db": "replay"}

ROW_LABEL = {
    "new-keys": "new-keys (pairs)",
    "replay": "replay (reads; replay cache on, the default)",
    "replay-db": "replay (reads; replay cache off: every read from Postgres)",
}


# The auth part: new-key pairs through servers with TLS and auth on or off.
AUTH_PREFIX = "auth-"
AUTH_LABEL = {
    "off": "auth off (plaintext)",
    "tls": "TLS only",
    "jwt": "TLS + JWT",
    "static": "TLS + static token",
}


def paired_ratios(base_runs, runs, base_key="ops_per_sec"):
    """runs / base_runs (e.g. service / pgbench) for each repetition both ran, in repetition order."""
    base = {r["rep"]: r[base_key] for r in base_runs}
    return [round(r["ops_per_sec"] / base[r["rep"]], 3)
            for r in sorted(runs, key=lambda r: r["rep"])
            if base.get(r["rep"]) and r["ops_per_sec"]]


def medians(rs, tool):
    """The medians of one row's runs (one tool, scenario and concurrency)."""
    s = {
        "ops_per_sec": median([r["ops_per_sec"] for r in rs]),
        "p50_us": median([r["latency_us"]["p50"] for r in rs]),
        "p99_us": median([r["latency_us"]["p99"] for r in rs]),
        "p999_us": median([r["latency_us"]["p999"] for r in rs]),
        "machine_cpu_busy": median([r.get("machine_cpu_busy") for r in rs]),
        # All the CPU the machine spent per operation: Postgres, the
        # server, pgbench or the load generator, the kernel.
        "machine_cpu_us_per_op": median([
            round(r["machine_cpu_busy"] * os.cpu_count() * 1e6 / r["ops_per_sec"])
            for r in rs if r.get("machine_cpu_busy") is not None and r["ops_per_sec"]]),
        "other_cpu_busy": median([r.get("other_cpu_busy") for r in rs]),
        "wal_bytes_per_op": median([r.get("wal_bytes_per_op") for r in rs]),
        "errors_total": sum(r.get("errors_total") or 0 for r in rs),
        "runs": rs,
    }
    if tool == "service":
        s["acquire_p50_us"] = median([r["acquire_latency_us"]["p50"] for r in rs])
        s["acquire_p99_us"] = median([r["acquire_latency_us"]["p99"] for r in rs])
        s["server_cpu_seconds"] = median([r.get("server_cpu_seconds") for r in rs])
        s["client_cpu_seconds"] = median([r.get("client_cpu_seconds") for r in rs])
        per_op = [r["server_cpu_seconds"] * 1e6 / r["ops"]
                  for r in rs if r.get("server_cpu_seconds") is not None and r["ops"]]
        s["server_cpu_us_per_op"] = round(median(per_op), 1) if per_op else None
        s["server_vmhwm_kb"] = max(r["server_vmhwm_kb"] for r in rs)
    return s


def auth_results(runs):
    """Each auth variant at each concurrency, against auth off in the same repetitions."""
    results = []
    order = []
    for r in runs:
        if (r["scenario"], r["concurrency"]) not in order:
            order.append((r["scenario"], r["concurrency"]))
    for scenario, c in order:
        rs = [r for r in runs if r["scenario"] == scenario and r["concurrency"] == c]
        s = medians(rs, "service")
        ops = [r["ops_per_sec"] for r in rs]
        per_op = [r["client_cpu_seconds"] * 1e6 / r["ops"]
                  for r in rs if r.get("client_cpu_seconds") is not None and r["ops"]]
        s.update({
            "variant": scenario[len(AUTH_PREFIX):], "concurrency": c,
            "ops_per_sec_min": min(ops), "ops_per_sec_max": max(ops),
            "client_cpu_us_per_op": round(median(per_op), 1) if per_op else None,
        })
        results.append(s)
    known = list(AUTH_LABEL)
    results.sort(key=lambda s: (s["concurrency"], known.index(s["variant"])
                                if s["variant"] in known else len(known)))
    for s in results:
        off = next((o for o in results
                    if o["variant"] == "off" and o["concurrency"] == s["concurrency"]), None)
        if off is None:
            s["ratio_to_off"], s["ratios_per_repeat"], s["ratio_per_repeat_median"] = None, [], None
            continue
        s["ratio_to_off"] = (round(s["ops_per_sec"] / off["ops_per_sec"], 3)
                             if s["ops_per_sec"] and off["ops_per_sec"] else None)
        # Each repetition against auth off in the same repetition (the
        # variants run one after another, a minute at most apart).
        s["ratios_per_repeat"] = paired_ratios(off["runs"], s["runs"])
        s["ratio_per_repeat_median"] = median(s["ratios_per_repeat"])
    return results


def ceiling_entry(name, ceiling, service_runs, service_ops):
    """A ceiling's keys/s, WAL per key and the service's pairs/s against it,
    overall and per repetition (each against that ceiling's run in the same
    repetition)."""
    keys_per_sec = median([r["keys_per_sec"] for r in ceiling])
    wal = [r["wal_bytes"] / (r["ops"] * r["keys_per_op"]) for r in ceiling if r["ops"]]
    return {
        f"{name}_keys_per_sec": keys_per_sec,
        f"{name}_wal_bytes_per_key": round(median(wal)) if wal else None,
        f"ratio_service_to_{name}": (round(service_ops / keys_per_sec, 3)
                                     if service_ops and keys_per_sec else None),
        f"{name}_ratios_per_repeat": paired_ratios(ceiling, service_runs, "keys_per_sec"),
    }


def summary(raw, out, meta_json):
    meta = json.loads(meta_json)
    all_runs = [json.loads(line) for line in open(raw)]
    runs = [r for r in all_runs
            if not r["scenario"].startswith(AUTH_PREFIX) and r["scenario"] != "memory"]
    memory = [r for r in all_runs if r["scenario"] == "memory"]
    auth = auth_results([r for r in all_runs if r["scenario"].startswith(AUTH_PREFIX)])
    order = []
    for r in runs:
        if r["tool"] == "service" and (r["scenario"], r["concurrency"]) not in order:
            order.append((r["scenario"], r["concurrency"]))
    results = []
    for scenario, c in order:
        entry = {"scenario": scenario, "concurrency": c}
        for tool in ("pgbench", "service"):
            # The replay runs without the server's cache compare with the same pgbench runs.
            wanted = PGBENCH_SCENARIO.get(scenario, scenario) if tool == "pgbench" else scenario
            rs = [r for r in runs
                  if r["tool"] == tool and r["scenario"] == wanted and r["concurrency"] == c]
            entry[tool] = medians(rs, tool)
        p, sv = entry["pgbench"]["ops_per_sec"], entry["service"]["ops_per_sec"]
        entry["ratio_service_to_pgbench"] = round(sv / p, 3) if p and sv else None
        # Each repetition's service run against the pgbench run just before
        # it: a minute apart, so both saw much the same machine. The machine's
        # speed drifts between repetitions, and the ratio with it.
        entry["ratios_per_repeat"] = paired_ratios(entry["pgbench"]["runs"], entry["service"]["runs"])
        entry["ratio_per_repeat_median"] = median(entry["ratios_per_repeat"])
        # The durable ceiling beside the new-key pairs: keys/s of the same
        # writes as 32-key statements, measured just before each service run.
        ceiling = [r for r in runs
                   if r["tool"] == "pgbench" and r["scenario"] == "ceiling" and r["concurrency"] == c]
        entry["ceiling_keys_per_sec"] = None
        entry["ratio_service_to_ceiling"] = None
        entry["ceiling_ratios_per_repeat"] = []
        if scenario == "new-keys" and ceiling:
            entry.update(ceiling_entry("ceiling", ceiling, entry["service"]["runs"], sv))
            entry["ceiling_clients"] = ceiling[0]["clients"]
            entry["ceiling_keys_per_statement"] = ceiling[0]["keys_per_op"]
        # The ceiling as it was until 2026-12-06 (its keys adjacent in the
        # index), at the concurrency where make bench measures it beside.
        adjacent = [r for r in runs if r["tool"] == "pgbench"
                    and r["scenario"] == "ceiling-adjacent" and r["concurrency"] == c]
        if scenario == "new-keys" and adjacent:
            entry.update(ceiling_entry("ceiling_adjacent", adjacent, entry["service"]["runs"], sv))
            # The new ceiling against the old, repetition by repetition.
            entry["ceiling_to_adjacent_per_repeat"] = [
                round(r["keys_per_sec"] / a["keys_per_sec"], 3)
                for r in sorted(ceiling, key=lambda r: r["rep"])
                for a in adjacent if a["rep"] == r["rep"] and a["keys_per_sec"]]
        results.append(entry)

    doc = {
        **meta,
        "machine": {"nproc": os.cpu_count(), "cpu_model": cpu_model(), "memory_gib": mem_gib(),
                    "kernel": platform.release(), "idle_wakeup": idle_wakeup()},
        "results": results,
        "memory": memory,
        "auth": auth,
    }
    with open(out + ".json", "w") as f:
        json.dump(doc, f, indent=2)

    def ms(us):
        return "-" if us is None else f"{us / 1000:.2f}"

    def num(x):
        return "-" if x is None else f"{x:,.0f}"

    def pct(x):
        return "-" if x is None else f"{x * 100:.0f}"

    lines = [] if results else ["(no pgbench comparison in this run)"]
    lines += [] if not results else [
        "| scenario | conc. | pgbench /s | service /s | service / pgbench "
        "| ceiling keys/s | service / ceiling "
        "| p50 / p99 ms, pgbench | p50 / p99 ms, service | server CPU s (µs/op) "
        "| server peak RSS MiB | machine CPU µs/op, pgbench / service "
        "| WAL bytes/op, pgbench / service | other load %, pgbench / service |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in results:
        p, s = e["pgbench"], e["service"]
        ratio = "-" if e["ratio_service_to_pgbench"] is None else f"{e['ratio_service_to_pgbench']:.2f}"
        to_ceiling = "-" if e["ratio_service_to_ceiling"] is None else f"{e['ratio_service_to_ceiling']:.2f}"
        cpu = "-"
        if s["server_cpu_seconds"] is not None:
            cpu = f"{s['server_cpu_seconds']:.2f} ({num(s['server_cpu_us_per_op'])})"
        lines.append(
            f"| {ROW_LABEL.get(e['scenario'], e['scenario'])} | {e['concurrency']} | {num(p['ops_per_sec'])} "
            f"| {num(s['ops_per_sec'])} | {ratio} | {num(e['ceiling_keys_per_sec'])} | {to_ceiling} "
            f"| {ms(p['p50_us'])} / {ms(p['p99_us'])} "
            f"| {ms(s['p50_us'])} / {ms(s['p99_us'])} | {cpu} | {s['server_vmhwm_kb'] / 1024:.0f} "
            f"| {num(p['machine_cpu_us_per_op'])} / {num(s['machine_cpu_us_per_op'])} "
            f"| {num(p['wal_bytes_per_op'])} / {num(s['wal_bytes_per_op'])} "
            f"| {pct(p['other_cpu_busy'])} / {pct(s['other_cpu_busy'])} |")
    errors = sum(e["pgbench"]["errors_total"] + e["service"]["errors_total"] for e in results)
    errors += sum(a["errors_total"] for a in auth)
    errors += sum(m.get("errors_total") or 0 for m in memory)
    pg = meta["postgres"]
    lines.append("")
    lines.append(
        f"Medians of {meta['settings']['repeats']} x {meta['settings']['seconds']} s; errors: {errors}; "
        f"Postgres {pg['version']}, fsync={pg['fsync']}, synchronous_commit={pg['synchronous_commit']}; "
        f"{os.cpu_count()} CPUs ({cpu_model()}; {idle_wakeup_text(doc['machine']['idle_wakeup'])}); "
        f"server at {meta.get('git_commit', '?')}.")
    lines.append("")
    if results:
        lines.append("Service / pgbench per repetition (each against the pgbench run just before it):")
        lines.append("")
    for e in results:
        if e["ratios_per_repeat"]:
            ratios = ", ".join(f"{r:.2f}" for r in e["ratios_per_repeat"])
            lines.append(f"- {ROW_LABEL.get(e['scenario'], e['scenario'])} at {e['concurrency']}: "
                         f"{ratios} (median {e['ratio_per_repeat_median']:.2f})")
    grouped = [e for e in results if e["scenario"] == "new-keys" and any(
        r.get("server_calls_per_statement") for r in e["service"]["runs"])]
    if grouped:
        lines.append("")
        lines.append(
            "Calls per Acquire statement per repetition (the server's "
            "idempotency_db_batch_size over the run, warm-up included; at 16 callers 16.0 "
            "when they move as one group, about 8 when they split into two that take turns):")
        lines.append("")
        for e in grouped:
            per = [(r.get("server_calls_per_statement") or {}).get("acquire")
                   for r in sorted(e["service"]["runs"], key=lambda r: r["rep"])]
            lines.append(f"- new-key pairs at {e['concurrency']}: "
                         + ", ".join("-" if x is None else f"{x:.1f}" for x in per))
    ceilings = [e for e in results if e["ceiling_ratios_per_repeat"]]
    if ceilings:
        lines.append("")
        lines.append(
            f"Service / ceiling per repetition (the ceiling: pgbench, {ceilings[0]['ceiling_clients']} "
            f"clients, multi-row statements of {ceilings[0]['ceiling_keys_per_statement']} keys, "
            "run just before each service run):")
        lines.append("")
        for e in ceilings:
            ratios = ", ".join(f"{r:.2f}" for r in e["ceiling_ratios_per_repeat"])
            lines.append(f"- new-key pairs at {e['concurrency']}: {ratios} "
                         f"(median {median(e['ceiling_ratios_per_repeat']):.2f}); "
                         f"the ceiling's WAL {num(e['ceiling_wal_bytes_per_key'])} bytes/key")
    adjacent = [e for e in results if e.get("ceiling_adjacent_ratios_per_repeat")]
    if adjacent:
        lines.append("")
        lines.append(
            "Beside it, the old ceiling (until 2026-12-06: a statement's keys adjacent in "
            "the index, bench/pgbench/ceiling_pair_adjacent.sql), run first in odd "
            "repetitions and last in even ones:")
        lines.append("")
        for e in adjacent:
            ratios = ", ".join(f"{r:.3f}" for r in e["ceiling_adjacent_ratios_per_repeat"])
            versus = ", ".join(f"{r:.3f}" for r in e.get("ceiling_to_adjacent_per_repeat", []))
            lines.append(
                f"- at {e['concurrency']}: {num(e['ceiling_adjacent_keys_per_sec'])} keys/s "
                f"against the ceiling's {num(e.get('ceiling_keys_per_sec'))} "
                f"(the ceiling / the old per repetition: {versus}; WAL "
                f"{num(e['ceiling_adjacent_wal_bytes_per_key'])} against "
                f"{num(e.get('ceiling_wal_bytes_per_key'))} bytes/key); service / old ceiling "
                f"{ratios} (median {median(e['ceiling_adjacent_ratios_per_repeat']):.3f})")
    if memory:
        lines += [""] + memory_table(memory, ms, num)
    if auth:
        lines += [""] + auth_table(auth, meta, ms, num, pct)
    table = "\n".join(lines)
    with open(out + ".md", "w") as f:
        f.write(table + "\n")
    print()
    print(table)
    print()
    print(f"results: {out}.json and {out}.md")


def memory_table(memory, ms, num):
    """Peak memory of a server holding many calls at once."""
    lines = [
        "Memory of calls in flight (a server of its own; new-key pairs, each call its own RPC, "
        "16 gRPC connections):",
        "",
        "| callers | most calls in flight seen | pairs/s | p50 / p99 ms "
        "| server peak RSS MiB | errors |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for m in memory:
        lines.append(
            f"| {m['concurrency']} | {num(m.get('server_in_flight_peak'))} | {num(m['ops_per_sec'])} "
            f"| {ms(m['latency_us']['p50'])} / {ms(m['latency_us']['p99'])} "
            f"| {m['server_vmhwm_kb'] / 1024:.1f} | {m.get('errors_total') or 0} |")
    return lines


def auth_label(variant, meta):
    label = AUTH_LABEL.get(variant, variant)
    files = meta.get("settings", {}).get("auth", {}).get("files", {})
    if variant == "jwt" and files.get("jwt"):
        label += f" ({files['jwt']['algorithm']}, {files['jwt']['bytes']:,} bytes)"
    return label


def auth_table(auth, meta, ms, num, pct):
    """The cost of TLS and auth: new-key pairs with each on, against off."""
    lines = [
        "The cost of TLS and auth (new-key pairs, one gRPC connection, variants interleaved):",
        "",
        "| new-key pairs | conc. | pairs/s (min–max) | / auth off | per repetition / off "
        "| p50 / p99 ms | Acquire p50 / p99 ms | server CPU µs/pair | load generator CPU µs/pair "
        "| machine CPU µs/pair | server peak RSS MiB | other load % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for a in auth:
        ratio = "-" if a["ratio_to_off"] is None else f"{a['ratio_to_off']:.3f}"
        per_rep = "-" if a["variant"] == "off" else (
            ", ".join(f"{r:.2f}" for r in a["ratios_per_repeat"]) or "-")
        lines.append(
            f"| {auth_label(a['variant'], meta)} | {a['concurrency']} "
            f"| {num(a['ops_per_sec'])} ({num(a['ops_per_sec_min'])}–{num(a['ops_per_sec_max'])}) "
            f"| {ratio} | {per_rep} | {ms(a['p50_us'])} / {ms(a['p99_us'])} "
            f"| {ms(a['acquire_p50_us'])} / {ms(a['acquire_p99_us'])} "
            f"| {num(a['server_cpu_us_per_op'])} | {num(a['client_cpu_us_per_op'])} "
            f"| {num(a['machine_cpu_us_per_op'])} | {a['server_vmhwm_kb'] / 1024:.0f} "
            f"| {pct(a['other_cpu_busy'])} |")
    return lines


def main(argv):
    command, args = argv[1], argv[2:]
    if command == "ticks":
        print(*ticks(*args))
    elif command == "other":
        print(cpu_fractions(*args)[1])
    elif command == "pgbench":
        print(json.dumps(pgbench_record(*args)))
    elif command == "statements":
        print(statement_counts(*args))
    elif command == "service":
        print(json.dumps(service_record(*args)))
    elif command == "progress":
        progress(*args)
    elif command == "summary":
        summary(*args)
    else:
        sys.exit(f"report.py: unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv)
