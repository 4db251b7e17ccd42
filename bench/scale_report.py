#!/usr/bin/env python3
"""Helpers of scripts/bench-scale.sh: one JSON line per measurement, the
reaper's runs from its log, and the summary (medians, tables, results
file). Standard library only; the CPU accounting is bench/report.py's.

  scale_report.py record PART LABEL JSON BEFORE AFTER   >> raw.jsonl
  scale_report.py progress RAW
  scale_report.py median-rate RAW PART
  scale_report.py reaper-runs LOG
  scale_report.py summary RAW META_JSONL OUT_PREFIX SETTINGS_JSON
"""

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import cpu_fractions, cpu_model, mem_gib  # noqa: E402


def record(part, label, path, before, after):
    r = json.load(open(path))
    busy, other = cpu_fractions(before, after)
    acq, lat = r["acquire_latency_us"], r["latency_us"]
    return {
        "part": part, "label": label, "ops_per_sec": r["ops_per_sec"], "ops": r["ops"],
        "seconds": r["seconds"], "errors_total": r["errors_total"], "errors": r["errors"],
        "rate": r.get("rate"), "ttl_seconds": r.get("ttl_seconds"),
        "acquire_p50_us": acq["p50"], "acquire_p99_us": acq["p99"], "acquire_p999_us": acq["p999"],
        "acquire_max_us": acq["max"], "pair_p50_us": lat["p50"], "pair_p99_us": lat["p99"],
        "server_cpu_seconds": r.get("server_cpu_seconds"), "machine_cpu_busy": busy,
        "other_cpu_busy": other,
    }


def progress(raw):
    r = json.loads(open(raw).read().splitlines()[-1])
    line = "bench-scale:   %-7s %-12s %9.1f pairs/s  Acquire p50 %6.2f ms  p99 %6.2f ms  other load %3.0f %%" % (
        r["part"], r["label"], r["ops_per_sec"], (r["acquire_p50_us"] or 0) / 1000,
        (r["acquire_p99_us"] or 0) / 1000, 100 * (r["other_cpu_busy"] or 0))
    if r["errors_total"]:
        line += "  errors %d" % r["errors_total"]
    print(line, file=sys.stderr)


def load(raw):
    with open(raw) as f:
        return [json.loads(line) for line in f if line.strip()]


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def median_rate(raw, part):
    return round(median([r["ops_per_sec"] for r in load(raw) if r["part"] == part]))


def reaper_runs(path):
    """The reaper's `reaper run` log lines (JSON log format)."""
    runs = []
    with open(path) as f:
        for line in f:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            # The server logs JSON with the event's fields at the top level.
            fields = entry.get("fields", entry)
            if fields.get("message") == "reaper run":
                runs.append({"at": entry.get("timestamp"), "deleted": fields["deleted"],
                             "batches": fields["batches"], "elapsed_ms": fields["elapsed_ms"]})
    return json.dumps(runs)


def fmt(v, digits=0):
    if v is None:
        return "–"
    return f"{v:,.{digits}f}"


def ms(us):
    return fmt(us / 1000 if us is not None else None, 2)


def sizes_table(runs, events):
    """Each size against the reference (an empty table measured alternately
    beside it), and against this table when it was empty."""
    rows = [r for r in runs if r["part"] == "sizes"]
    if not rows:
        return [], {}
    snaps = {e["size"]: e["state"] for e in events if e["event"] == "snapshot"}
    refs = {e["size"]: e["rows"] for e in events if e["event"] == "reference"}
    loads = {e["to_rows"]: e for e in events if e["event"] == "load" and not e.get("expired")}
    labels = []
    for r in rows:
        if r["label"] not in labels:
            labels.append(r["label"])
    base = [r for r in rows if r["label"] == labels[0]]
    base_rate = median([r["ops_per_sec"] for r in base])
    base_p99 = median([r["acquire_p99_us"] for r in base])
    out = ["| Live rows | pairs/s: this table (each run) | reference (each run) | **vs reference** (per repetition) "
           "| Acquire p99 ms: this table / reference | **p99 vs reference** | vs this table empty: pairs/s, p99 "
           "| other load %, this table / reference |",
           "|---:|---|---|---:|---:|---:|---:|---|"]
    disk = ["| Live rows | bytes/key: total = heap + indexes + TOAST | row (pg_column_size) | PK index levels "
            "| PK / expires_at index MB | blocks read from outside shared_buffers (of all) | checkpoints | autovacuums |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    summary = {}
    for label in labels:
        rs = [r for r in rows if r["label"] == label]
        ref = [r for r in runs if r["part"] == "reference" and r["label"] == label]
        rate, p50, p99 = (median([r[k] for r in rs]) for k in ("ops_per_sec", "acquire_p50_us", "acquire_p99_us"))
        ref_rate, ref_p99 = (median([r[k] for r in ref]) for k in ("ops_per_sec", "acquire_p99_us"))
        per_rep = [round(a["ops_per_sec"] / b["ops_per_sec"], 2) for a, b in zip(rs, ref) if b["ops_per_sec"]]
        per_rep_p99 = [round(a["acquire_p99_us"] / b["acquire_p99_us"], 2) for a, b in zip(rs, ref)
                       if b["acquire_p99_us"]]
        s = snaps.get(int(label), {}) or {}
        n = s.get("rows") or 1
        io = s.get("stat_io") or {}
        hit = sum(io.get(k) or 0 for k in ("heap_blks_hit", "idx_blks_hit", "toast_blks_hit"))
        read = sum(io.get(k) or 0 for k in ("heap_blks_read", "idx_blks_read", "toast_blks_read"))
        bg = s.get("bgwriter") or {}
        st = s.get("stat_table") or {}
        per_key = {k: round((s.get(k + "_bytes") or 0) / n) for k in ("total", "heap", "index", "toast")}
        summary[label] = {
            "preloaded_rows": int(label), "rows_after": s.get("rows"), "reference_rows_after": refs.get(int(label)),
            "pairs_per_sec": rate, "pairs_per_sec_runs": [r["ops_per_sec"] for r in rs],
            "reference_pairs_per_sec": ref_rate, "reference_runs": [r["ops_per_sec"] for r in ref],
            "ratio_to_reference": round(rate / ref_rate, 3) if ref_rate else None,
            "ratios_per_repeat": per_rep, "ratio_per_repeat_median": median(per_rep),
            "acquire_p50_us": p50, "acquire_p99_us": p99, "acquire_p99_runs_us": [r["acquire_p99_us"] for r in rs],
            "reference_acquire_p99_us": ref_p99,
            "reference_acquire_p99_runs_us": [r["acquire_p99_us"] for r in ref],
            "p99_ratio_to_reference": round(p99 / ref_p99, 3) if ref_p99 else None,
            "p99_ratios_per_repeat": per_rep_p99,
            "ratio_to_empty": round(rate / base_rate, 3) if base_rate else None,
            "p99_ratio_to_empty": round(p99 / base_p99, 3) if base_p99 else None,
            "bytes_per_key": per_key, "avg_row_bytes": s.get("avg_row_bytes"),
            "pkey_levels": s.get("pkey_levels"), "blocks_hit": hit, "blocks_read": read,
            "other_cpu_busy_runs": [r["other_cpu_busy"] for r in rs],
            "reference_other_cpu_busy_runs": [r["other_cpu_busy"] for r in ref],
            "statements": s.get("statements"), "bgwriter": bg, "stat_table": st,
            "load": loads.get(int(label)),
        }
        out.append("| %s | %s (%s) | %s (%s) | **%s** (%s) | %s / %s | **%s** (%s) | %s, %s | %s / %s |" % (
            fmt(int(label)), fmt(rate), ", ".join(fmt(r["ops_per_sec"]) for r in rs),
            fmt(ref_rate), ", ".join(fmt(r["ops_per_sec"]) for r in ref),
            fmt(rate / ref_rate if ref_rate else None, 2), ", ".join("%.2f" % x for x in per_rep),
            ms(p99), ms(ref_p99), fmt(p99 / ref_p99 if ref_p99 else None, 2), ", ".join("%.2f" % x for x in per_rep_p99),
            fmt(rate / base_rate if base_rate else None, 2), fmt(p99 / base_p99 if base_p99 else None, 2),
            ", ".join(fmt(100 * (r["other_cpu_busy"] or 0)) for r in rs),
            ", ".join(fmt(100 * (r["other_cpu_busy"] or 0)) for r in ref)))
        disk.append("| %s | %s = %s + %s + %s | %s | %s | %s / %s | %s of %s (%.2f %%) | %s | %s |" % (
            fmt(int(label)), fmt(per_key["total"]), fmt(per_key["heap"]), fmt(per_key["index"]),
            fmt(per_key["toast"]), s.get("avg_row_bytes", "–"), s.get("pkey_levels", "–"),
            fmt((s.get("pkey_bytes") or 0) / 1e6), fmt((s.get("expires_idx_bytes") or 0) / 1e6),
            fmt(read), fmt(read + hit), 100 * read / max(1, read + hit),
            (bg.get("checkpoints_timed") or 0) + (bg.get("checkpoints_req") or 0),
            st.get("autovacuum_count", "–")))
    return out + [""] + disk, summary


def reaper_table(runs, events):
    parts = [r for r in runs if r["part"] == "reaper"]
    if not parts:
        return [], {}
    rates = next((e for e in events if e["event"] == "rates"), {})
    reaped = next((e for e in events if e["event"] == "reaped"), {})
    idle = [r for r in parts if r["label"].startswith("idle")]
    idle_p99 = median([r["acquire_p99_us"] for r in idle])
    out = ["| Phase | runs | pairs/s (target %s) | Acquire p50 ms | Acquire p99 ms, median (range) | p99 vs idle | other load %% |" % fmt(rates.get("paced")),
           "|---|---:|---:|---:|---:|---:|---:|"]
    summary = {"max_pairs_per_sec": rates.get("max"), "paced_pairs_per_sec": rates.get("paced"),
               "max_runs": [r["ops_per_sec"] for r in runs if r["part"] == "max"]}
    for label in ("idle-before", "reaping", "idle-after"):
        rs = [r for r in parts if r["label"] == label]
        if not rs:
            continue
        p99s = [r["acquire_p99_us"] for r in rs]
        p99 = median(p99s)
        summary[label] = {"runs": len(rs), "pairs_per_sec": median([r["ops_per_sec"] for r in rs]),
                          "acquire_p50_us": median([r["acquire_p50_us"] for r in rs]),
                          "acquire_p99_us": p99, "acquire_p99_runs_us": p99s,
                          "p99_ratio_to_idle": round(p99 / idle_p99, 3) if idle_p99 else None,
                          "errors": sum(r["errors_total"] for r in rs),
                          "other_cpu_busy_runs": [r["other_cpu_busy"] for r in rs]}
        out.append("| %s | %d | %s | %s | %s (%s–%s) | %s | %s |" % (
            label, len(rs), fmt(summary[label]["pairs_per_sec"]), ms(summary[label]["acquire_p50_us"]),
            ms(p99), ms(min(p99s)), ms(max(p99s)),
            "**%.2f**" % (p99 / idle_p99) if idle_p99 else "–",
            fmt(100 * median([r["other_cpu_busy"] for r in rs]))))
    if reaped:
        rr = reaped.get("runs") or []
        deleted = sum(r["deleted"] for r in rr)
        busy = sum(r["elapsed_ms"] for r in rr) / 1000
        summary["reaper"] = {"rows": reaped["rows"], "wall_seconds": reaped["seconds"],
                             "rows_per_sec_wall": round(reaped["rows"] / reaped["seconds"]),
                             "runs": rr, "deleted_in_runs": deleted,
                             "rows_per_sec_in_runs": round(deleted / busy) if busy else None}
        out.append("")
        out.append("Reaper (`idempotencyd reap`%s): %s expired rows deleted in %s s from its start to an "
                   "empty backlog, **%s rows/s**; within its runs (%d, %s s in all) %s rows/s; runs: %s." % (
                       "", fmt(reaped["rows"]), fmt(reaped["seconds"], 1),
                       fmt(summary["reaper"]["rows_per_sec_wall"]), len(rr), fmt(busy, 1),
                       fmt(summary["reaper"]["rows_per_sec_in_runs"]),
                       ", ".join("%s rows in %.1f s" % (fmt(r["deleted"]), r["elapsed_ms"] / 1000) for r in rr)))
    return out, summary


def soak_table(events, settings):
    soak = next((e for e in events if e["event"] == "soak"), None)
    if not soak:
        return [], {}
    samples = soak["samples"]
    ttl = float(soak["ttl"].rstrip("s")) if soak["ttl"].endswith("s") and soak["ttl"][:-1].replace(".", "").isdigit() else 60.0
    # After the first cycle: a key's TTL, then up to two reaper intervals
    # (60 s at the defaults) until a run deletes it and the next one starts.
    settle = ttl + 120
    out = ["| t s | table MB (heap + indexes) | rows | expired, not yet deleted | dead tuples | autovacuums |",
           "|---:|---:|---:|---:|---:|---:|"]
    for s in samples:
        out.append("| %s | %s (%s + %s) | %s | %s | %s | %s |" % (
            fmt(s["t"]), fmt(s["total_bytes"] / 1e6, 1), fmt(s["heap_bytes"] / 1e6, 1),
            fmt(s["index_bytes"] / 1e6, 1), fmt(s["rows"]), fmt(s["expired_rows"]), fmt(s["n_dead_tup"]),
            s["autovacuum_count"]))
    after = [s for s in samples if s["t"] >= settle]
    summary = {"rate": soak["rate"], "ttl": soak["ttl"], "settle_seconds": settle,
               "reaper_runs": soak.get("reaper_runs"), "samples": samples}
    if len(after) >= 3:
        third = max(1, len(after) // 3)
        first = median([s["total_bytes"] for s in after[:third]])
        last = median([s["total_bytes"] for s in after[-third:]])
        xs = [s["t"] / 60 for s in after]
        ys = [s["total_bytes"] / 1e6 for s in after]
        mx, my = statistics.mean(xs), statistics.mean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(1e-9, sum((x - mx) ** 2 for x in xs))
        summary.update({"size_first_third_bytes": first, "size_last_third_bytes": last,
                        "growth_last_vs_first_third": round(last / first - 1, 4),
                        "slope_mb_per_min": round(slope, 2),
                        "max_bytes_after_settle": max(s["total_bytes"] for s in after),
                        "min_bytes_after_settle": min(s["total_bytes"] for s in after)})
        out.append("")
        out.append("After the first cycle (t ≥ %d s): table %s MB (median of the first third of the samples) "
                   "→ %s MB (last third), **%+.1f %%**; least-squares slope %+.2f MB/min; range %s–%s MB." % (
                       settle, fmt(first / 1e6, 1), fmt(last / 1e6, 1), 100 * (last / first - 1), slope,
                       fmt(summary["min_bytes_after_settle"] / 1e6, 1), fmt(summary["max_bytes_after_settle"] / 1e6, 1)))
    return out, summary


def pg_units(settings):
    """'262144' with unit '8kB' reads as 2097152kB (the script pasted unit after setting)."""
    for name, value in settings.items():
        if isinstance(value, str) and value.endswith("8kB") and value[:-3].isdigit():
            settings[name] = "%dMB" % (int(value[:-3]) * 8 // 1024)
    return settings


def summary(raw, meta, out_prefix, settings_json):
    runs = load(raw)
    events = load(meta)
    settings = json.loads(settings_json)
    pg_units(settings["postgres"])
    lines = ["# bench-scale %s (`%s`)" % (settings["timestamp"], settings["git_commit"]), "",
             "Postgres %s: %s; %s callers, %s s per measurement, medians of %s." % (
                 settings["postgres"].get("server_version"),
                 ", ".join("%s=%s" % kv for kv in sorted(settings["postgres"].items()) if kv[0] != "server_version"),
                 settings["concurrency"], settings["seconds"], settings["repeats"]), ""]
    result = {"settings": settings, "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "mem_gib": mem_gib()},
              "runs": runs, "events": [e for e in events if e["event"] != "soak"]}
    for name, (table, data) in (("sizes", sizes_table(runs, events)), ("reaper", reaper_table(runs, events)),
                                ("soak", soak_table(events, settings))):
        if table:
            lines += ["## " + name, ""] + table + [""]
            result[name] = data
    for e in events:
        if e["event"] == "load":
            lines.append("Loaded %s rows%s in %s s (%s rows/s)%s." % (
                fmt(e["rows"]), " (expired)" if e.get("expired") else "", fmt(e["seconds"], 1),
                fmt(e["rows"] / max(e["seconds"], 0.1)),
                ", then VACUUM (ANALYZE) in %s s" % e["vacuum_seconds"] if "vacuum_seconds" in e else ""))
    text = "\n".join(lines) + "\n"
    with open(out_prefix + ".md", "w") as f:
        f.write(text)
    with open(out_prefix + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print(text)
    print("bench-scale: results in %s.{md,json}" % out_prefix, file=sys.stderr)


def main(argv):
    command, args = argv[1], argv[2:]
    if command == "record":
        print(json.dumps(record(*args)))
    elif command == "progress":
        progress(*args)
    elif command == "median-rate":
        print(median_rate(*args))
    elif command == "reaper-runs":
        print(reaper_runs(*args))
    elif command == "summary":
        summary(*args)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
