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
concurrencies=${BUDGET_CONCURRENCY:-1 16}
server_bin=target/release/idempotencyd
bench_bin=target/release/idempotency-bench
pg_bin=$(dirname "$(command -v pg_ctl 2>/dev/null || ls -d /usr/lib/postgresql/*/bin/pg_ctl | sort -V | tail -n 1)")
pgbench=$(command -v pgbench 2>/dev/null || echo "$pg_bin/pgbench")
psql=$(command -v psql 2>/dev/null || echo "$pg_bin/psql")
sql() { "$psql" -X -q -A -t -v ON_ERROR_STOP=1 "$DATABASE_URL" -c "$1"; }
work=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-budget.XXXXXX")
server_pid=
cleanup() {
  if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

"$server_bin" migrate >"$work/migrate.log" 2>&1 || { cat "$work/migrate.log" >&2; exit 1; }
sql "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
grpc_port=$(free_port) metrics_port=$(free_port)
"$server_bin" serve --grpc-addr "127.0.0.1:$grpc_port" --metrics-addr "127.0.0.1:$metrics_port" \
  --reaper-enabled false --worker-threads 1 >"$work/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$grpc_port") 2>/dev/null && break; sleep 0.1; done
metrics() { python3 -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())' \
  "http://127.0.0.1:$metrics_port/metrics"; }
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
  say "$c callers: the service ${seconds}s (after 2 s untimed)"
  "$bench_bin" --endpoint "http://127.0.0.1:$grpc_port" --scenario new-keys --concurrency "$c" \
    --duration 2s --warmup 0s --json >/dev/null
  reset
  metrics >"$work/before.prom"
  "$bench_bin" --endpoint "http://127.0.0.1:$grpc_port" --scenario new-keys --concurrency "$c" \
    --duration "${seconds}s" --warmup 0s --server-pid "$server_pid" --json >"$work/service.json"
  metrics >"$work/after.prom"
  sv_acquire=$(statements 'WITH input AS') sv_finish=$(statements 'WITH v AS') sv_wal=$(wal)
  python3 bench/budget_report.py "$c" "$work" "$pg_insert" "$pg_update" "$pg_wal" \
    "$sv_acquire" "$sv_finish" "$sv_wal"
done
