#!/usr/bin/env bash
# `make bench-budget`: where a new-key pair's time goes, hop by hop, at
# BUDGET_CONCURRENCY callers (default "1 16"), against pgbench's pair on the
# same throwaway Postgres (fsync on). For each concurrency, BENCH_SECONDS (8)
# of pgbench bench/pgbench/new_key_pair.sql, then of the load generator's
# new-key pairs, with three clocks read around each:
#   - the load generator's, per call (pair and Acquire);
#   - the server's /metrics: idempotency_request_duration_seconds (the call
#     inside the server) and idempotency_db_query_duration_seconds (the
#     statement from the server's side, commit included);
#   - Postgres's: pg_stat_statements (execution and planning per statement)
#     and pg_stat_wal (WAL flushes and their time).
# At one caller also pgbench's pair with a pause of BUDGET_PAUSE_US (250) µs
# before each statement, as long as a lone caller's statement waits outside
# Postgres in the service: what idle gaps alone cost the statements here.
# Then, at the same concurrency, round trips with nothing behind them, the
# floors under every call: pgbench's `SELECT 1` (bench/pgbench/round_trip.sql:
# a round trip to Postgres), a gRPC health Check answered by tonic alone
# (`idempotency-bench --serve-health`: no layers, no engine) and by the
# server, and an Acquire replayed from the server's cache.
# Then new-key pairs against the floor (`idempotency-bench --serve-floor`:
# pgbench's two statements behind tonic alone), through the generated stub
# and through the client library, beside the same against the server and
# pgbench's pair: what a gRPC hop and the driver cost here at all, and what
# our server and our client add to them.
# Then replays through Postgres (a second server with --replay-cache-bytes
# 0) beside pgbench's primary-key SELECT (replay.sql) and beside pgbench
# running the service's own Acquire statement (acquire_replay.sql): what the
# statement's shape costs in Postgres, and what the server adds to it.
# At one caller, last, pgbench's pair and SELECT through sqlx alone
# (`idempotency-bench --driver-floor`): the driver's floor per statement.
# The server and the load generator run one thread each, as in make bench.
# docs/performance.md, "Where a call's time goes at low load", reads these.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf 'bench-budget: %s\n' "$*" >&2; }

if [ -z "${BUDGET_INNER:-}" ]; then
  cargo build --release --locked -p idempotency-server -p idempotency-bench
  exec env -u DATABASE_URL BUDGET_INNER=1 PG_FSYNC=on \
    PG_OPTIONS="-c shared_preload_libraries=pg_stat_statements -c track_wal_io_timing=on -c pg_stat_statements.track_planning=on" \
    scripts/with-postgres.sh "$0" "$@"
fi

seconds=${BENCH_SECONDS:-8}
floor_seconds=${BUDGET_FLOOR_SECONDS:-4}
BUDGET_PAUSE_US=${BUDGET_PAUSE_US:-250}
keys=1000
concurrencies=${BUDGET_CONCURRENCY:-1 16}
server_bin=target/release/idempotencyd
bench_bin=target/release/idempotency-bench
# shellcheck source=scripts/pg-client.sh
. scripts/pg-client.sh
work=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-budget.XXXXXX")
server_pid= uncached_pid= bare_pid= floor_pid=
cleanup() {
  for pid in $server_pid $uncached_pid $bare_pid $floor_pid; do
    kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT

"$server_bin" migrate >"$work/migrate.log" 2>&1 || { cat "$work/migrate.log" >&2; exit 1; }
sql "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return; sleep 0.1; done; }
grpc_port=$(free_port) metrics_port=$(free_port)
"$server_bin" serve --grpc-addr "127.0.0.1:$grpc_port" --metrics-addr "127.0.0.1:$metrics_port" \
  --reaper-enabled false --worker-threads 1 >"$work/server.log" 2>&1 &
server_pid=$!
uncached_port=$(free_port) uncached_metrics_port=$(free_port)
"$server_bin" serve --grpc-addr "127.0.0.1:$uncached_port" --metrics-addr "127.0.0.1:$uncached_metrics_port" \
  --reaper-enabled false --worker-threads 1 --replay-cache-bytes 0 >"$work/uncached.log" 2>&1 &
uncached_pid=$!
bare_port=$(free_port)
"$bench_bin" --serve-health "127.0.0.1:$bare_port" --serve-for 1h --threads 1 >"$work/bare.log" 2>&1 &
bare_pid=$!
floor_port=$(free_port)
"$bench_bin" --serve-floor "127.0.0.1:$floor_port" --serve-for 1h --threads 1 >"$work/floor.log" 2>&1 &
floor_pid=$!
wait_port "$grpc_port"; wait_port "$uncached_port"; wait_port "$bare_port"; wait_port "$floor_port"
metrics() { python3 -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())' \
  "http://127.0.0.1:${1:-$metrics_port}/metrics"; }
# The keys replay.sql and acquire_replay.sql read, stored as the service stores them.
"$psql" -X -q -v ON_ERROR_STOP=1 -v keys="$keys" -v payload="256" -f bench/pgbench/replay_keys.sql "$DATABASE_URL" >/dev/null
# The service's replay keys, completed once through the server without the cache.
"$bench_bin" --endpoint "http://127.0.0.1:$uncached_port" --scenario replay --concurrency 1 \
  --count 1 --warmup 0s --key-prefix budget --keys "$keys" --json >/dev/null
sql ANALYZE >/dev/null
# Generic plans and index paths, as the server's pool runs its statements.
serving_options="-c plan_cache_mode=force_generic_plan -c enable_seqscan=off -c enable_bitmapscan=off -c jit=off"
pgbench_mean() { # script, clients, extra args: the mean latency in µs
  local script=$1 c=$2; shift 2
  PGOPTIONS="$serving_options" "$pgbench" -M prepared -n -c "$c" -j 2 -T "$floor_seconds" -f "$script" "$@" \
    "$DATABASE_URL" >"$work/floor.out" 2>&1 || { cat "$work/floor.out" >&2; exit 1; }
  python3 -c 'import re, sys; print(float(re.search(r"latency average = ([0-9.]+) ms", open(sys.argv[1]).read()).group(1)) * 1000)' "$work/floor.out"
}
service_run() { # port, scenario, concurrency, extra args: the JSON report
  local port=$1 scenario=$2 c=$3; shift 3
  "$bench_bin" --endpoint "http://127.0.0.1:$port" --scenario "$scenario" --concurrency "$c" \
    --duration "${floor_seconds}s" --warmup 1s --json "$@"
}
statements() { # a regex on the statement's text: calls|exec ms|plan ms
  sql "SELECT coalesce(sum(calls), 0), coalesce(sum(total_exec_time), 0), coalesce(sum(total_plan_time), 0)
       FROM pg_stat_statements WHERE query ~ '$1'"
}
wal() { sql "SELECT wal_sync, wal_sync_time FROM pg_stat_wal"; }
reset() { sql "SELECT pg_stat_statements_reset()" >/dev/null; sql "SELECT pg_stat_reset_shared('wal')" >/dev/null; sql CHECKPOINT >/dev/null; }

for c in $concurrencies; do
  say "$c callers: pgbench ${seconds}s"
  reset
  "$pgbench" -M prepared -n -c "$c" -j 2 -T "$seconds" -r -f bench/pgbench/new_key_pair.sql \
    -D payload=256 "$DATABASE_URL" >"$work/pgbench.out" 2>&1 || { cat "$work/pgbench.out" >&2; exit 1; }
  pg_insert=$(statements '^INSERT INTO idempotency_records') pg_update=$(statements '^UPDATE idempotency_records')
  pg_wal=$(wal)
  rm -f "$work/pgbench-paused.out" "$work/pgbench-paused.wal"
  if [ "$c" = 1 ]; then
    # The same pair with a pause before each statement, as long as a lone
    # caller's statement waits outside Postgres in the service (the reply
    # to the caller, its next call, the server's own work): what those
    # pauses alone cost pgbench's statements, its backend and the disk
    # idle meanwhile.
    awk -v pause="$BUDGET_PAUSE_US" '/^(INSERT|UPDATE) /{print "\\sleep " pause " us"} {print}' \
      bench/pgbench/new_key_pair.sql >"$work/pair-paused.sql"
    say "1 callers: pgbench ${seconds}s with ${BUDGET_PAUSE_US} µs pauses"
    reset
    "$pgbench" -M prepared -n -c 1 -j 1 -T "$seconds" -r -f "$work/pair-paused.sql" \
      -D payload=256 "$DATABASE_URL" >"$work/pgbench-paused.out" 2>&1 || { cat "$work/pgbench-paused.out" >&2; exit 1; }
    wal >"$work/pgbench-paused.wal"
  fi
  say "$c callers: the service ${seconds}s (after 2 s untimed)"
  "$bench_bin" --endpoint "http://127.0.0.1:$grpc_port" --scenario new-keys --concurrency "$c" \
    --duration 2s --warmup 0s --json >/dev/null
  reset
  metrics >"$work/before.prom"
  "$bench_bin" --endpoint "http://127.0.0.1:$grpc_port" --scenario new-keys --concurrency "$c" \
    --duration "${seconds}s" --warmup 0s --server-pid "$server_pid" --json >"$work/service.json"
  metrics >"$work/after.prom"
  # Both forms of each: the array statement of a batch, the plain one of a call alone.
  sv_acquire=$(statements 'INSERT INTO idempotency_records') sv_finish=$(statements 'UPDATE idempotency_records') sv_wal=$(wal)
  python3 bench/budget_report.py "$c" "$work" "$pg_insert" "$pg_update" "$pg_wal" \
    "$sv_acquire" "$sv_finish" "$sv_wal"

  say "$c callers: new-key pairs against the floor, ${floor_seconds}s each"
  # The floor (idempotency-bench --serve-floor): pgbench's two statements
  # behind tonic alone, one per call. Through the generated stub and through
  # the client library, against the floor and against the server: what
  # a gRPC hop and the driver cost, what our server and our client add.
  service_run "$floor_port" new-keys "$c" --raw-stub >"$work/pair-floor-stub.json"
  service_run "$floor_port" new-keys "$c" >"$work/pair-floor-library.json"
  service_run "$grpc_port" new-keys "$c" --raw-stub --server-pid "$server_pid" >"$work/pair-server-stub.json"
  service_run "$grpc_port" new-keys "$c" --server-pid "$server_pid" >"$work/pair-server-library.json"
  pgbench_mean bench/pgbench/new_key_pair.sql "$c" -D payload=256 >"$work/pair-pg.txt"
  python3 bench/budget_report.py --pairs "$c" "$work"

  say "$c callers: round trips with nothing behind them, ${floor_seconds}s each"
  pgbench_mean bench/pgbench/round_trip.sql "$c" >"$work/floor-pg.txt"
  service_run "$bare_port" health "$c" >"$work/floor-bare.json"
  service_run "$grpc_port" health "$c" >"$work/floor-health.json"
  service_run "$grpc_port" replay "$c" --key-prefix budget-cached --keys "$keys" >"$work/floor-cached.json"

  say "$c callers: replays through Postgres, ${floor_seconds}s each"
  reset
  pgbench_mean bench/pgbench/replay.sql "$c" -D "keys=$keys" >"$work/replay-pg.txt"
  pg_select=$(statements '^SELECT state, fingerprint')
  reset
  pgbench_mean bench/pgbench/acquire_replay.sql "$c" -D "keys=$keys" -D ns=bench -D "op=POST /bench" \
    -D sub=pgbench -D "ttl=24 hours" -D "lease=60 s" -D wait=100ms \
    -D 'fp=\x000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f' >"$work/replay-shape.txt"
  pg_shape=$(statements 'WITH input AS')
  reset
  metrics "$uncached_metrics_port" >"$work/before.prom"
  service_run "$uncached_port" replay "$c" --key-prefix budget --keys "$keys" --skip-prepare \
    --server-pid "$uncached_pid" >"$work/replay-service.json"
  metrics "$uncached_metrics_port" >"$work/after.prom"
  # A call alone: the plain insert, then the read of the key it found; once
  # replays turned the server to reading first, one statement that reads
  # (its text begins `WITH existing AS (SELECT ...`, an insert in it); and
  # once they are most calls, the plain read alone.
  sv_replay=$(statements 'INSERT INTO idempotency_records') sv_read=$(statements '^\s*SELECT state, fingerprint')
  python3 bench/budget_report.py --floors "$c" "$work" "$pg_select" "$pg_shape" "$sv_replay" "$sv_read"

  if [ "$c" = 1 ]; then
    # pgbench's statements through sqlx alone (idempotency-bench
    # --driver-floor), one at a time on one connection: what the driver and
    # tokio cost per statement beside pgbench's libpq, with no gRPC between.
    say "1 callers: pgbench's statements through sqlx alone, ${floor_seconds}s each"
    for what in pair select; do
      PGOPTIONS="$serving_options" "$bench_bin" --driver-floor "$what" --keys "$keys" --threads 1 \
        --duration "${floor_seconds}s" --warmup 1s >"$work/driver-$what.json"
    done
    python3 bench/budget_report.py --driver "$work"
  fi
done
