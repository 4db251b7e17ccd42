#!/usr/bin/env bash
# `make bench-stream`: what a streaming RPC would buy. A caller's batches sent
# as messages of one long-lived bidirectional stream instead of one unary RPC
# each, against the floor and against the real server, on one throwaway
# Postgres (fsync on), for each batch size of STREAM_BATCHES (default "1 16").
#
# The server side is a measurement prototype (bench/prototypes/server-steps.patch,
# never merged): the bench's stream of steps (bench/src/steps.rs) served by the
# server's own handlers. The script applies it to a scratch worktree of HEAD and
# builds that into target/stream-prototype; the checkout is not touched.
#
# With B the batch size and K = STREAM_CALLERS (default 1), B x K pairs are
# in flight. In each round, one after the other (the order rotated each round,
# so that each mode takes each place once in every n rounds of n modes, and
# reversed in the next n; a VACUUM before each, autovacuum off):
#   pgbench        pgbench's new-key pair (bench/pgbench/new_key_pair.sql), B x K
#                  clients (not at one pair in flight, where the modes are compared
#                  with each other);
#   lib            the server, loaded by the client library with B x K callers
#                  (unary calls; its batching makes batch RPCs of them);
#   unary          the server, K callers batching by hand (--raw-stub --raw-batch B):
#                  a BatchAcquire and a BatchComplete of B per op;
#   stream         the same callers and batches, each caller's as messages of one
#                  stream (--raw-stream);
#   floor-unary    the floor with the server's statements (--serve-floor
#                  --floor-statements service), the caller of `unary`;
#   floor-stream   the same floor, the caller of `stream`.
# Prints each mode's median pairs/s, server and load generator CPU per pair,
# the op's p50 (a lone caller's pair, or a batch of B pairs of each kind), and
# the ratios by round.
#
# The prototype server runs with --request-timeout 1h: its layers see each
# stream as one call, which the default 10 s would cut. It serves the stream
# with auth off only (no caller reaches its handlers).
#
# STREAM_BATCHES, STREAM_CALLERS, STREAM_ROUNDS (8), BENCH_SECONDS (4).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf 'bench-stream: %s\n' "$*" >&2; }

if [ -z "${STREAM_INNER:-}" ]; then
  cargo build --release --locked -p idempotency-bench
  # The prototype on the committed server (HEAD): uncommitted changes to the
  # server are not in it.
  root=$PWD
  scratch=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-stream.XXXXXX")
  trap 'git worktree remove --force "$scratch/tree" >/dev/null 2>&1; git worktree prune; rm -rf "$scratch"' EXIT
  git worktree add --quiet --detach "$scratch/tree" HEAD
  git -C "$scratch/tree" apply "$root/bench/prototypes/server-steps.patch" || {
    say "bench/prototypes/server-steps.patch no longer applies to HEAD: refresh it"
    exit 1
  }
  # Not --locked: the patch gives the server a dependency the lock already
  # holds (tonic-prost), which cargo adds to the scratch copy's lock at the
  # version locked.
  (cd "$scratch/tree" && cargo build --release -p idempotency-server \
    --target-dir "$root/target/stream-prototype")
  # A throwaway Postgres of its own, whatever DATABASE_URL says.
  env -u DATABASE_URL STREAM_INNER=1 PG_FSYNC=on scripts/with-postgres.sh "$0" "$@"
  exit
fi

unset PGBENCH_RANDOM_SEED
seconds=${BENCH_SECONDS:-4}
rounds=${STREAM_ROUNDS:-8}
batches=${STREAM_BATCHES:-1 16}
callers=${STREAM_CALLERS:-1}
server_bin=target/stream-prototype/release/idempotencyd
bench_bin=target/release/idempotency-bench
# shellcheck source=scripts/pg-client.sh
. scripts/pg-client.sh
work=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-stream.XXXXXX")
pids=""
trap 'kill $pids 2>/dev/null; rm -rf "$work"' EXIT

# shellcheck source=scripts/bench-ports.sh
. scripts/bench-ports.sh

"$server_bin" migrate >"$work/migrate.log" 2>&1 || { cat "$work/migrate.log" >&2; exit 1; }
"$psql" -X -q -v ON_ERROR_STOP=1 -v keys=1000 -v payload=256 -f bench/pgbench/replay_keys.sql \
  "$DATABASE_URL" >/dev/null
sql "ANALYZE idempotency_records"
sql "ALTER TABLE idempotency_records SET (autovacuum_enabled = false)"

read -r port_server port_floor port_metrics < <(free_ports 3)
"$server_bin" serve --grpc-addr "127.0.0.1:$port_server" --metrics-addr "127.0.0.1:$port_metrics" \
  --reaper-enabled false --worker-threads 1 --request-timeout 1h >"$work/server.log" 2>&1 &
pid_server=$!
"$bench_bin" --serve-floor "127.0.0.1:$port_floor" --floor-statements service \
  --serve-for 1h --threads 1 >"$work/floor.log" 2>&1 &
pid_floor=$!
pids="$pid_server $pid_floor"
wait_port "$port_server"; wait_port "$port_floor"

serving_options="-c plan_cache_mode=force_generic_plan -c enable_seqscan=off -c enable_bitmapscan=off -c jit=off"

measure() { # mode batch round: appends "mode round pairs/s server-cpu loadgen-cpu p50" to $work/BATCH.txt
  local mode=$1 b=$2 round=$3 port=$port_server pid=$pid_server args c=$(($2 * callers))
  sql "VACUUM idempotency_records" >/dev/null
  if [ "$mode" = pgbench ]; then
    PGOPTIONS=$serving_options "$pgbench" -M prepared -n -c "$c" -j 2 -T "$seconds" \
      -f bench/pgbench/new_key_pair.sql -D payload=256 "$DATABASE_URL" \
      >"$work/pgbench.out" 2>"$work/pgbench.err" || { cat "$work/pgbench.err" >&2; exit 1; }
    grep -q '^tps' "$work/pgbench.out" || { say "pgbench printed no tps"; cat "$work/pgbench.out" >&2; exit 1; }
    awk -v r="$round" '/^tps/ { print "pgbench", r, $3 }' "$work/pgbench.out" >>"$work/$b.txt"
    return
  fi
  case $mode in
    lib) args="--concurrency $c" ;;
    unary | floor-unary) args="--concurrency $callers --raw-stub --raw-batch $b" ;;
    stream | floor-stream) args="--concurrency $callers --raw-stub --raw-batch $b --raw-stream" ;;
  esac
  case $mode in floor-*) port=$port_floor pid=$pid_floor ;; esac
  # shellcheck disable=SC2086 # $args is words
  "$bench_bin" --endpoint "http://127.0.0.1:$port" --scenario new-keys $args --threads 1 \
    --duration "${seconds}s" --warmup 1s --payload-bytes 256 --server-pid "$pid" --json \
    >"$work/run.json" 2>"$work/run.err" || { cat "$work/run.err" >&2; exit 1; }
  python3 - "$mode" "$round" "$work/run.json" >>"$work/$b.txt" <<'EOF'
import json, sys
mode, round_, path = sys.argv[1:4]
d = json.load(open(path))
if d["errors_total"]:
    sys.exit(f"bench-stream: {mode}: {d['errors_total']} errors: {d['errors']}")
pairs = d["ops"] * d["pairs_per_op"]
print(mode, round_, d["ops_per_sec"] * d["pairs_per_op"], 1e6 * d["server_cpu_seconds"] / pairs,
      1e6 * d["client_cpu_seconds"] / pairs, d["latency_us"]["p50"])
EOF
}

for b in $batches; do
  modes=(pgbench lib unary stream floor-unary floor-stream)
  [ $((b * callers)) = 1 ] && modes=(lib unary stream floor-unary floor-stream)
  n=${#modes[@]}
  for round in $(seq "$rounds"); do
    order=()
    for i in "${!modes[@]}"; do order+=("${modes[$(((i + round) % n))]}"); done
    if [ $(((round - 1) / n % 2)) = 1 ]; then
      mapfile -t order < <(printf '%s\n' "${order[@]}" | tac)
    fi
    for mode in "${order[@]}"; do measure "$mode" "$b" "$round"; done
    say "batches of $b, $callers caller(s) by hand: round $round of $rounds"
  done
  python3 - "$b x $callers" "$work/$b.txt" <<'EOF'
import collections, statistics as st, sys
c, path = sys.argv[1:3]
runs = collections.defaultdict(dict)
for line in open(path):
    mode, round_, *values = line.split()
    runs[mode][int(round_)] = [float(v) for v in values]
print(f"\nbatches x callers by hand: {c}; medians of {len(next(iter(runs.values())))} rounds")
print("| mode | pairs/s | server CPU µs/pair | load generator CPU µs/pair | op p50 µs |")
print("|---|---:|---:|---:|---:|")
for mode, by_round in runs.items():
    cols = list(zip(*by_round.values()))
    cells = [f"{st.median(col):,.0f}" if i == 0 else f"{st.median(col):.1f}" for i, col in enumerate(cols)]
    print(f"| {mode} | " + " | ".join(cells + [""] * (4 - len(cells))) + " |")
def ratio(a, b):
    if a not in runs or b not in runs: return
    r = [runs[a][k][0] / runs[b][k][0] for k in runs[a] if k in runs[b]]
    print(f"{a} / {b}: median {st.median(r):.3f} (min {min(r):.3f}, max {max(r):.3f}; higher in {sum(x > 1 for x in r)} of {len(r)})")
for a, b in [("lib", "pgbench"), ("unary", "pgbench"), ("stream", "pgbench"), ("stream", "unary"),
             ("stream", "lib"), ("floor-stream", "floor-unary"), ("unary", "floor-unary")]:
    ratio(a, b)
def p50_gap(a, b):
    d = [runs[a][k][3] - runs[b][k][3] for k in runs[a] if k in runs[b]]
    print(f"op p50, {a} - {b}: median {st.median(d):+.0f} µs (per round {', '.join(f'{x:+.0f}' for x in d)})")
p50_gap("stream", "unary"); p50_gap("stream", "lib")
EOF
done
