#!/usr/bin/env bash
# `make bench-client-stream`: the client library's batches as messages of its
# BatchStream (the default) against the same batches as batch RPCs
# (`--no-stream`), with pgbench's new-key pair beside them, on one throwaway
# Postgres (fsync on) and one release server at its defaults (one worker
# thread, as `make bench` runs it), for each caller count of STREAM_CALLERS
# (default "1 16 64").
#
# In each round, one after the other (the order rotated each round and
# reversed every other, a VACUUM before each, autovacuum off):
#   pgbench   pgbench's new-key pair (bench/pgbench/new_key_pair.sql), C clients;
#   rpc       the load generator's C callers through the client library, one
#             connection, batches as BatchAcquire/BatchComplete RPCs;
#   stream    the same, batches (and lone calls) on the client's BatchStream.
# Prints, per caller count, the medians and spreads of stream/rpc, stream and
# rpc over pgbench, and the pair's p50 against pgbench's (its average latency
# at one client, which is its p50 within a few µs).
# STREAM_ROUNDS (default 6) and BENCH_SECONDS (default 4) tune it.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "bench-client-stream: $*" >&2; }
# shellcheck source=scripts/bench-ports.sh
. scripts/bench-ports.sh

cargo build --release --locked -p idempotency-server -p idempotency-bench >&2
work=$(mktemp -d)
export work
trap 'rm -rf "$work"' EXIT
export STREAM_CALLERS=${STREAM_CALLERS:-"1 16 64"} STREAM_ROUNDS=${STREAM_ROUNDS:-6} \
  BENCH_SECONDS=${BENCH_SECONDS:-4}
read -r grpc_port metrics_port < <(free_ports 2)
export grpc_port metrics_port
# Never a configured database: the rounds vacuum and turn autovacuum off.
PG_FSYNC=on env -u DATABASE_URL scripts/with-postgres.sh bash -c '
  set -euo pipefail
  . scripts/bench-ports.sh
  . scripts/pg-client.sh
  say() { echo "bench-client-stream: $*" >&2; }
  B=target/release/idempotency-bench S=target/release/idempotencyd
  $S migrate >/dev/null
  "$psql" -X -q -v ON_ERROR_STOP=1 -v keys=1000 -v payload=256 -f bench/pgbench/replay_keys.sql "$DATABASE_URL" >/dev/null
  sql "ANALYZE idempotency_records"
  sql "ALTER TABLE idempotency_records SET (autovacuum_enabled = false)"
  $S serve --grpc-addr 127.0.0.1:$grpc_port --metrics-addr 127.0.0.1:$metrics_port \
    --reaper-enabled false --drain-timeout 5s --worker-threads 1 >"$work/server.log" 2>&1 &
  server=$!
  trap "kill $server 2>/dev/null || true" EXIT
  wait_port "$grpc_port"
  opts="-c plan_cache_mode=force_generic_plan -c jit=off"
  modes=(pgbench rpc stream)
  for c in $STREAM_CALLERS; do
    for r in $(seq "$STREAM_ROUNDS"); do
      order=()
      for i in 0 1 2; do order+=("${modes[$(( (i + r) % 3 ))]}"); done
      if [ $((r % 2)) = 0 ]; then order=("${order[2]}" "${order[1]}" "${order[0]}"); fi
      for m in "${order[@]}"; do
        sql "VACUUM idempotency_records" >/dev/null
        case $m in
          pgbench)
            PGOPTIONS="$opts" "$pgbench" -M prepared -n -c "$c" -j 2 -T "$BENCH_SECONDS" \
              -f bench/pgbench/new_key_pair.sql -D payload=256 "$DATABASE_URL" 2>/dev/null |
              awk -v c="$c" -v r="$r" "/^tps/ {t=\$3} /latency average/ {l=\$4} END {print \"R\", c, r, \"pgbench\", t, l * 1000}";;
          rpc|stream)
            extra=(); [ "$m" = rpc ] && extra=(--no-stream)
            $B --endpoint "http://127.0.0.1:$grpc_port" --scenario new-keys --concurrency "$c" \
              --connections 1 "${extra[@]}" --duration "${BENCH_SECONDS}s" --warmup 1s \
              --payload-bytes 256 --keys 1000 --server-pid "$server" --json 2>>"$work/bench.err" |
              python3 -c "import json, sys
d = json.load(sys.stdin)
assert d[\"errors_total\"] == 0, d[\"errors\"]
print(\"R\", sys.argv[1], sys.argv[2], sys.argv[3], d[\"ops_per_sec\"], d[\"latency_us\"][\"p50\"])" "$c" "$r" "$m";;
        esac
      done
    done
  done' | tee "$work/rounds.txt"
python3 - "$work/rounds.txt" <<'PY'
import collections, statistics as st, sys
rounds = collections.defaultdict(dict)
for line in open(sys.argv[1]):
    p = line.split()
    if p and p[0] == "R":
        rounds[(int(p[1]), p[2])][p[3]] = (float(p[4]), float(p[5]))
by_callers = collections.defaultdict(list)
for (c, _), modes in rounds.items():
    if len(modes) == 3:
        by_callers[c].append(modes)
def spread(xs):
    return f"{st.median(xs):.3f} ({min(xs):.3f}–{max(xs):.3f})"
print("\n| callers | rounds | stream / rpc | higher in | stream / pgbench | rpc / pgbench | pair p50 over pgbench's, stream | rpc |")
print("|---:|---:|---|---:|---|---|---:|---:|")
for c, rs in sorted(by_callers.items()):
    ratio = [r["stream"][0] / r["rpc"][0] for r in rs]
    sp = [r["stream"][0] / r["pgbench"][0] for r in rs]
    rp = [r["rpc"][0] / r["pgbench"][0] for r in rs]
    gs = st.median(r["stream"][1] - r["pgbench"][1] for r in rs)
    gr = st.median(r["rpc"][1] - r["pgbench"][1] for r in rs)
    print(f"| {c} | {len(rs)} | {spread(ratio)} | {sum(x > 1 for x in ratio)} of {len(ratio)} "
          f"| {spread(sp)} | {spread(rp)} | {gs:+.0f} µs | {gr:+.0f} µs |")
PY
