#!/usr/bin/env bash
# Two builds of the server against each other: scripts/bench-ab.sh A B, where A
# and B are idempotencyd binaries (e.g. one built from the commit before a
# change, copied aside, and target/release/idempotencyd). Both serve one
# throwaway Postgres (fsync on) at once, each with one worker thread and the
# reaper off, as in make bench; the load generator (target/release/
# idempotency-bench, one thread) loads one, then the other, the order swapped
# every round, with pgbench's new-key pair beside them in each round. A
# difference seen in most rounds is one this machine resolves; one run of
# each, minutes apart, is not (docs/performance.md, "Comparing two variants").
#
# AB_LOADGEN=1: A and B are two builds of the load generator (idempotency-bench,
# to compare two client libraries) loading one server, target/release/
# idempotencyd, with the load generator's default threads, as in make bench.
# Each measurement prints the server's calls per statement over it.
#
# AB_CONCURRENCY (1), AB_ROUNDS (6), AB_SECONDS (4), AB_SCENARIO (new-keys,
# replay or mixed), AB_SERVER_ARGS (flags for both servers, e.g.
# --replay-cache-bytes 0; AB_SERVER_ARGS_A and AB_SERVER_ARGS_B add flags for
# one of them, e.g. TLS and auth for B alone: a server with --tls-cert is
# called over https), AB_CLIENT_ARGS (flags for the load generator, with
# AB_CLIENT_ARGS_A and AB_CLIENT_ARGS_B for one side; e.g. --mix 10:90).
# Prints each measurement, then per round B against A (p50 difference, pairs/s
# ratio) and their medians, and each server's rows per statement.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf 'bench-ab: %s\n' "$*" >&2; }

if [ -z "${AB_INNER:-}" ]; then
  if [ $# -ne 2 ] || [ ! -x "$1" ] || [ ! -x "$2" ]; then
    say "usage: scripts/bench-ab.sh A_IDEMPOTENCYD B_IDEMPOTENCYD (two executables)"
    say "       AB_LOADGEN=1 scripts/bench-ab.sh A_IDEMPOTENCY_BENCH B_IDEMPOTENCY_BENCH"
    exit 2
  fi
  if [ "${AB_LOADGEN:-0}" = 1 ]; then
    cargo build --release --locked -p idempotency-server
  else
    cargo build --release --locked -p idempotency-bench
  fi
  exec env -u DATABASE_URL AB_INNER=1 PG_FSYNC=on scripts/with-postgres.sh "$0" "$(realpath "$1")" "$(realpath "$2")"
fi

a_bin=$1 b_bin=$2
c=${AB_CONCURRENCY:-1} rounds=${AB_ROUNDS:-6} seconds=${AB_SECONDS:-4}
scenario=${AB_SCENARIO:-new-keys}
loadgen=${AB_LOADGEN:-0}
bench_a=target/release/idempotency-bench bench_b=target/release/idempotency-bench
threads=(--threads 1)
if [ "$loadgen" = 1 ]; then
  # The two binaries are load generators; both load the one server.
  bench_a=$a_bin bench_b=$b_bin a_bin=target/release/idempotencyd b_bin=target/release/idempotencyd
  threads=()
fi
# shellcheck source=scripts/pg-client.sh
. scripts/pg-client.sh
work=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-ab.XXXXXX")
pids=""
trap 'kill $pids 2>/dev/null; rm -rf "$work"' EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

"$b_bin" migrate >/dev/null

start() { # name binary; sets port_<name>, metrics_<name>, pid_<name>
  local grpc metrics
  grpc=$(free_port)
  metrics=$(free_port)
  local own=AB_SERVER_ARGS_${1^^} scheme=http
  [[ " ${AB_SERVER_ARGS:-} ${!own:-} " == *" --tls-cert "* ]] && scheme=https
  printf -v "scheme_$1" '%s' "$scheme"
  # shellcheck disable=SC2086 # AB_SERVER_ARGS are lists of flags
  "$2" serve --grpc-addr "127.0.0.1:$grpc" --metrics-addr "127.0.0.1:$metrics" \
    --reaper-enabled false --worker-threads 1 ${AB_SERVER_ARGS:-} ${!own:-} >"$work/$1.log" 2>&1 &
  pids="$pids $!"
  printf -v "pid_$1" '%s' "$!"
  printf -v "port_$1" '%s' "$grpc"
  printf -v "metrics_$1" '%s' "$metrics"
  for _ in $(seq 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$grpc") 2>/dev/null && return
    sleep 0.1
  done
  say "server $1 did not start; its log:"
  cat "$work/$1.log" >&2
  exit 1
}
start a "$a_bin"
if [ "$loadgen" = 1 ]; then
  pid_b=$pid_a port_b=$port_a metrics_b=$metrics_a scheme_b=$scheme_a
  say "A $bench_a, B $bench_b, both loading $a_bin (pid $pid_a); $rounds rounds of ${seconds}s, $scenario, $c callers"
else
  start b "$b_bin"
  say "A $a_bin (pid $pid_a), B $b_bin (pid $pid_b); $rounds rounds of ${seconds}s, $scenario, $c callers"
fi

statements() { python3 bench/report.py statements "$1"; }

measure() { # name round
  local port=port_$1 pid=pid_$1 metrics=metrics_$1 bench=bench_$1 scheme=scheme_$1
  local own=AB_CLIENT_ARGS_${1^^} before
  "$psql" -q -c CHECKPOINT "$DATABASE_URL" >/dev/null
  before=$(statements "${!metrics}")
  # shellcheck disable=SC2086 # AB_CLIENT_ARGS are lists of flags
  "${!bench}" --endpoint "${!scheme}://127.0.0.1:${!port}" --scenario "$scenario" --concurrency "$c" \
    --connections 1 "${threads[@]}" --duration "${seconds}s" --warmup 1s --payload-bytes 256 \
    --keys 1000 --server-pid "${!pid}" ${AB_CLIENT_ARGS:-} ${!own:-} --json >"$work/$1-$2.json"
  python3 - "$work/$1-$2.json" "$1" "$before" "$(statements "${!metrics}")" <<'EOF'
import json, sys
sys.path.insert(0, "bench")
from report import calls_per_statement
d = json.load(open(sys.argv[1]))
cpu = lambda k: 1e6 * (d[k] or 0) / d["ops"]
per = calls_per_statement(sys.argv[3], sys.argv[4]) or {}
print(f"{sys.argv[2].upper()}        {d['ops_per_sec']:9.1f}/s  p50 {d['latency_us']['p50']:6d} µs  "
      f"server CPU {cpu('server_cpu_seconds'):5.0f} µs/op  load generator {cpu('client_cpu_seconds'):4.0f}  "
      "calls per statement " + ", ".join(f"{k} {v}" for k, v in sorted(per.items())))
EOF
}

for round in $(seq "$rounds"); do
  if [ "$scenario" = new-keys ]; then
    "$psql" -q -c CHECKPOINT "$DATABASE_URL" >/dev/null
    "$pgbench" -M prepared -n -c "$c" -j "$((c > 1 ? 2 : 1))" -T "$seconds" \
      -f bench/pgbench/new_key_pair.sql -D payload=256 "$DATABASE_URL" 2>/dev/null |
      awk '/^latency average/ { lat = $4 } /^tps/ { tps = $3 }
           END { printf "pgbench  %9.1f/s  mean %6.0f µs\n", tps, lat * 1000 }'
  fi
  if [ $((round % 2)) = 1 ]; then measure a "$round"; measure b "$round"; else measure b "$round"; measure a "$round"; fi
done

python3 - "$work" "$rounds" <<'EOF'
import json, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
load = lambda name, r: json.load(open(f"{work}/{name}-{r}.json"))
diffs, ratios = [], []
for r in range(1, rounds + 1):
    a, b = load("a", r), load("b", r)
    diffs.append(b["latency_us"]["p50"] - a["latency_us"]["p50"])
    ratios.append(b["ops_per_sec"] / a["ops_per_sec"])
print("B against A, per round: p50 " + " / ".join(f"{d:+d}" for d in diffs) + " µs; ops/s "
      + " / ".join(f"{x:.3f}" for x in ratios))
print(f"medians: p50 {statistics.median(diffs):+.0f} µs, ops/s {statistics.median(ratios):.3f}x; "
      f"B faster in {sum(x > 1 for x in ratios)} of {rounds} rounds")
EOF
servers="a b"
if [ "$loadgen" = 1 ]; then servers=a; fi
for name in $servers; do
  metrics=metrics_$name
  # The server's totals, as bench/report.py reads them ("kind:calls:statements,...").
  python3 - "$name" "$(statements "${!metrics}")" <<'EOF'
import sys
sys.path.insert(0, "bench")
from report import parse_statement_counts
rows = sorted(parse_statement_counts(sys.argv[2]).items())
print(sys.argv[1].upper(), "rows per statement:", ", ".join(
    f"{q} {calls / n:.2f} over {n:.0f}" for q, (calls, n) in rows if n))
EOF
done
