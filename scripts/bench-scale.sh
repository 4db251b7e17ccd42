#!/usr/bin/env bash
# `make bench-scale` and `make bench-reaper`: what the table's size and its
# cleanup cost the service, on one throwaway Postgres with fsync on.
#
# Parts (SCALE_PARTS; `make bench-scale` runs "sizes", `make bench-reaper`
# "reaper soak"):
#   sizes:  new-key pairs (Acquire + Complete) at SCALE_CONCURRENCY (64)
#           callers with 0, then 10 and 30 million live rows in the table
#           (SCALE_ROWS, loaded one step after the other with
#           INSERT ... SELECT FROM generate_series, then VACUUM ANALYZE):
#           pairs/s and Acquire p99 as ratios to an empty table measured
#           alternately beside it (a second database, a second server), bytes per
#           key on disk, and what Postgres did meanwhile (pg_stat_statements,
#           buffer hits and reads, checkpoints, autovacuum, index depth).
#   reaper: the maximum pairs/s, then a backlog of REAPER_BACKLOG (5M)
#           expired rows, and the service at REAPER_LOAD (50 %) of that
#           maximum (or at REAPER_RATE pairs/s, the maximum then not measured),
#           paced, without and while `idempotencyd reap` (the
#           documented command, its defaults) deletes the backlog: Acquire
#           p99 in both, and the reaper's rows/s.
#   soak:   SOAK_SECONDS (1200) of new keys at the same paced rate with a
#           TTL of SOAK_TTL (60s), the server's own reaper on at its
#           defaults; table size and dead tuples every SOAK_SAMPLE (30) s.
#
# Every measurement is the load generator's (`idempotency-bench`) with
# random UUID keys over SCALE_SUBJECTS (100000) subjects, so that new keys
# land all over the primary key index as many users' keys do. Each
# measurement of the sizes and reaper parts runs BENCH_SECONDS (10) and is
# repeated BENCH_REPEATS (5) times; the tables show medians. Results:
# target/bench/scale-<timestamp>.{json,md} and, for the soak, the raw
# samples in the JSON. Other load on the machine is measured around every
# measurement, as `make bench` does.
#
# Postgres runs with shared_buffers=2GB, max_wal_size=4GB, pg_stat_statements
# and track_io_timing (a production-like setting for a table of tens of GB,
# the same for every size), plus SCALE_PG_OPTIONS (e.g. "-c
# shared_buffers=256MB": a later -c wins). The servers' and the reaper's logs
# are kept in target/bench/scale-<timestamp>.logs/.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf 'bench-scale: %s\n' "$*" >&2; }

default_pg_options="-c shared_buffers=2GB -c max_wal_size=4GB -c shared_preload_libraries=pg_stat_statements"
default_pg_options="$default_pg_options -c track_io_timing=on -c log_autovacuum_min_duration=0 -c log_checkpoints=on"

if [ -z "${BENCH_INNER:-}" ]; then
  command -v python3 >/dev/null || { say "python3 is needed for the tables"; exit 1; }
  started=$(date +%s)
  say "building release binaries"
  cargo build --release --locked -p idempotency-server -p idempotency-bench
  say "disk before: $(df -h --output=avail "${TMPDIR:-/tmp}" | tail -n 1 | tr -d ' ') free in ${TMPDIR:-/tmp}"
  status=0
  env -u DATABASE_URL BENCH_INNER=1 PG_FSYNC=on PG_OPTIONS="$default_pg_options ${SCALE_PG_OPTIONS:-}" \
    scripts/with-postgres.sh "$0" "$@" || status=$?
  say "took $(($(date +%s) - started)) s"
  exit "$status"
fi

# ---- inside scripts/with-postgres.sh: DATABASE_URL is the throwaway cluster ----

parts=${SCALE_PARTS:-sizes}
seconds=${BENCH_SECONDS:-10}
repeats=${BENCH_REPEATS:-5}
warmup=${BENCH_WARMUP:-2s}
payload=${BENCH_PAYLOAD_BYTES:-256}
concurrency=${SCALE_CONCURRENCY:-64}
sizes=${SCALE_ROWS:-0 10000000 30000000}
subjects=${SCALE_SUBJECTS:-100000}
chunk=${SCALE_LOAD_CHUNK:-1000000}
backlog=${REAPER_BACKLOG:-5000000}
load_share=${REAPER_LOAD:-50}
reaper_args=${REAPER_ARGS:-}
soak_seconds=${SOAK_SECONDS:-1200}
soak_ttl=${SOAK_TTL:-60s}
soak_sample=${SOAK_SAMPLE:-30}
server_args=${BENCH_SERVER_ARGS:-}
for part in $parts; do
  case $part in sizes | reaper | soak) ;; *) say "SCALE_PARTS: unknown part $part (sizes, reaper, soak)"; exit 1 ;; esac
done
part() { [[ " $parts " == *" $1 "* ]]; }

server_bin=target/release/idempotencyd
bench_bin=target/release/idempotency-bench
report() { python3 bench/scale_report.py "$@"; }
# shellcheck source=scripts/pg-client.sh
. scripts/pg-client.sh

stamp=$(date -u +%Y%m%dT%H%M%SZ)
out_dir=target/bench
mkdir -p "$out_dir"
work=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-scale.XXXXXX")
raw="$out_dir/scale-$stamp.runs.jsonl" # kept, with the events below
: >"$raw"

pids=
cleanup() {
  local pid
  for pid in $pids; do
    kill -0 "$pid" 2>/dev/null || continue
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  mkdir -p "$out_dir/scale-$stamp.logs"
  cp "$work"/*.log "$out_dir/scale-$stamp.logs/" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

fsync=$(sql "SHOW fsync")
sync_commit=$(sql "SHOW synchronous_commit")
if [ "$fsync" != on ] || [ "$sync_commit" != on ]; then
  say "refusing to measure without fsync=on and synchronous_commit=on"
  exit 1
fi
pg_settings=$(sql "SELECT json_object_agg(name, current_setting(name)) FROM pg_settings
  WHERE name IN ('server_version', 'shared_buffers', 'max_wal_size', 'checkpoint_timeout', 'work_mem',
                 'maintenance_work_mem', 'effective_cache_size', 'wal_sync_method', 'fsync',
                 'synchronous_commit', 'full_page_writes', 'autovacuum', 'max_connections')")
say "Postgres: $pg_settings"
data_dir=$(sql 'SHOW data_directory')
postmaster_pid=$(head -n 1 "$data_dir/postmaster.pid")
"$server_bin" migrate >"$work/migrate.log" 2>&1 || { cat "$work/migrate.log" >&2; exit 1; }
sql "CREATE EXTENSION IF NOT EXISTS pg_stat_statements" >/dev/null
sql "CREATE EXTENSION IF NOT EXISTS pageinspect" >/dev/null

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

start_server() { # log-name extra serve flags...; sets server_pid and endpoint
  local log="$work/$1.log" grpc_port metrics_port
  shift
  grpc_port=$(free_port)
  metrics_port=$(free_port)
  while [ "$metrics_port" = "$grpc_port" ]; do metrics_port=$(free_port); done
  # shellcheck disable=SC2086 # server_args is a list of flags
  DATABASE_URL=${server_db_url:-$DATABASE_URL} \
    "$server_bin" serve --grpc-addr "127.0.0.1:$grpc_port" --metrics-addr "127.0.0.1:$metrics_port" \
    --worker-threads "${BENCH_SERVER_THREADS:-1}" --drain-timeout 5s --log-format json $server_args "$@" \
    >"$log" 2>&1 &
  server_pid=$!
  pids="$pids $server_pid"
  for _ in $(seq 100); do
    kill -0 "$server_pid" 2>/dev/null || { say "the server exited; its log:"; cat "$log" >&2; exit 1; }
    (exec 3<>"/dev/tcp/127.0.0.1/$grpc_port") 2>/dev/null && break
    sleep 0.1
  done
  endpoint="http://127.0.0.1:$grpc_port"
}

stop_server() {
  kill -TERM "$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
}

ticks() { python3 bench/report.py ticks "$postmaster_pid" "$server_pid" "$$"; }

# One run of the load generator: new keys at $concurrency callers; extra
# arguments go to it (--rate, --duration, --ttl). Appends a JSON line with
# the label, the other load and the run's own figures to $raw.
measure() { # part label extra-args...
  local part=$1 label=$2 before
  shift 2
  before=$(ticks)
  "$bench_bin" --endpoint "$endpoint" --scenario new-keys --concurrency "$concurrency" \
    --warmup "$warmup" --payload-bytes "$payload" --uuid-keys --subjects "$subjects" \
    --server-pid "$server_pid" --json "$@" >"$work/run.json" 2>"$work/run.err" ||
    { cat "$work/run.err" >&2; exit 1; }
  if [ -s "$work/run.err" ]; then sed 's/^/  /' "$work/run.err" >&2; fi
  kill -0 "$server_pid" 2>/dev/null || { say "the server died; its log:"; cat "$work"/server*.log >&2; exit 1; }
  report record "$part" "$label" "$work/run.json" "$before" "$(ticks)" >>"$raw"
  report progress "$raw"
}

# Rows as the service stores a completed record: namespace 'bench',
# operation 'POST /bench', a subject among user-0 .. user-<subjects-1>, a
# random UUID key, a 32-byte fingerprint, a 256-byte body, expiring between
# now() + min and now() + max seconds, later for rows loaded later (as
# expiries grow with time). One statement per $chunk rows, its rows sorted by
# key: each statement still lands all over the primary key index (so its pages
# split as under random inserts), but visits each page once, so the load
# writes a full-page image per page and checkpoint rather than per row. The
# load's own session compresses its WAL (wal_compression=lz4); the
# measurements run without. Stops early, saying so, when fewer than
# SCALE_MIN_FREE_GB (5) GB are left on the cluster's disk.
load_rows() { # rows min-offset-s max-offset-s; prints the rows loaded and the seconds
  local rows=$1 lo=$2 hi=$3 done=0 n t0 free_kb
  t0=$(date +%s.%N)
  while [ "$done" -lt "$rows" ]; do
    free_kb=$(df --output=avail "$data_dir" | tail -n 1)
    if [ "$free_kb" -lt $((${SCALE_MIN_FREE_GB:-5} * 1048576)) ]; then
      say "  only $((free_kb / 1048576)) GB left on the disk: stopping the load at $done rows"
      break
    fi
    n=$((rows - done < chunk ? rows - done : chunk))
    sql "SET wal_compression = lz4; SET work_mem = '512MB';
         INSERT INTO idempotency_records
           (namespace, operation, subject, key, state, fingerprint, fencing_token, created_at,
            expires_at, lease_expires_at, completed_at, response_status, response_body, response_headers)
         SELECT 'bench', 'POST /bench', subject, key, 'completed',
                '\\x000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f'::bytea,
                idempotency_lifetime_token(), now(),
                now() + make_interval(secs => $lo + ($hi - $lo) * ($done + row_number() OVER ())::float8 / $rows),
                NULL, now(), 201, convert_to(repeat('x', $payload), 'UTF8'), '{}'
         FROM (SELECT 'user-' || (random() * ($subjects - 1))::int AS subject, gen_random_uuid()::text AS key
               FROM generate_series(1, $n) ORDER BY 1, 2) AS k"
    done=$((done + n))
    say "  loaded $done / $rows rows ($(python3 -c "import time; print(round($done / (time.time() - $t0)))") rows/s)"
  done
  echo "$done $(python3 -c "import time; print(round(time.time() - $t0, 1))")"
}

# The table's state and what Postgres did since the last reset, as JSON.
snapshot() {
  sql_snapshot || echo null
}
sql_snapshot() {
  sql "SELECT json_build_object(
     'rows', (SELECT count(*) FROM idempotency_records),
     'total_bytes', pg_total_relation_size('idempotency_records'),
     'heap_bytes', pg_relation_size('idempotency_records'),
     'toast_bytes', coalesce(pg_total_relation_size(nullif(c.reltoastrelid, 0)), 0),
     'index_bytes', pg_indexes_size('idempotency_records'),
     'pkey_bytes', pg_relation_size('idempotency_records_pkey'),
     'expires_idx_bytes', pg_relation_size('idempotency_records_expires_at_idx'),
     'pkey_levels', (SELECT level FROM bt_metap('idempotency_records_pkey')),
     'expires_idx_levels', (SELECT level FROM bt_metap('idempotency_records_expires_at_idx')),
     'avg_row_bytes', (SELECT avg(pg_column_size(r.*))::int FROM
                        (SELECT * FROM idempotency_records TABLESAMPLE SYSTEM (0.1) LIMIT 10000) r),
     'stat_table', (SELECT row_to_json(t) FROM (SELECT n_live_tup, n_dead_tup, autovacuum_count,
                     autoanalyze_count, vacuum_count, n_tup_ins, n_tup_hot_upd, n_tup_upd, n_tup_del
                     FROM pg_stat_user_tables WHERE relname = 'idempotency_records') t),
     'stat_io', (SELECT row_to_json(t) FROM (SELECT heap_blks_read, heap_blks_hit, idx_blks_read,
                  idx_blks_hit, toast_blks_read, toast_blks_hit
                  FROM pg_statio_user_tables WHERE relname = 'idempotency_records') t),
     'bgwriter', (SELECT row_to_json(b) FROM (SELECT checkpoints_timed, checkpoints_req,
                  checkpoint_write_time, checkpoint_sync_time, buffers_checkpoint, buffers_clean,
                  buffers_backend, buffers_backend_fsync FROM pg_stat_bgwriter) b),
     'statements', (SELECT json_agg(s) FROM (SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 90) AS query,
                     calls, rows, round(total_exec_time::numeric, 1) AS total_ms,
                     round((total_exec_time / greatest(calls, 1))::numeric, 3) AS mean_ms,
                     shared_blks_hit, shared_blks_read, shared_blks_dirtied, shared_blks_written,
                     round(blk_read_time::numeric, 1) AS read_ms, round(blk_write_time::numeric, 1) AS write_ms,
                     wal_bytes
                     FROM pg_stat_statements WHERE calls > 100 AND query ILIKE '%idempotency_records%'
                       AND dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
                     ORDER BY total_exec_time DESC LIMIT 6) s))
   FROM pg_class c WHERE c.relname = 'idempotency_records'"
}

reset_stats() { sql "SELECT pg_stat_statements_reset(), pg_stat_reset(), pg_stat_reset_shared('bgwriter')" >/dev/null; }

meta_file="$out_dir/scale-$stamp.events.jsonl"
: >"$meta_file"
note() { printf '%s\n' "$1" | tr '\n' ' ' >>"$meta_file"; echo >>"$meta_file"; } # one JSON object a line

# ---------------------------------------------------------------- sizes --
# Two servers on the same cluster: one on the table that grows, one on the
# same table in a second database that stays (nearly) empty, the
# reference. Their measurements alternate (reference first in odd
# repetitions, last in even ones), so that both see the same minutes of this
# shared machine and of Postgres (its WAL, its checkpoints, its CPU): each
# size is compared with the reference measured beside it. At size 0 both
# tables are empty, which shows how far two identical setups differ here.
if part sizes; then
  ref_url="${DATABASE_URL%/*}/reference"
  sql "CREATE DATABASE reference" >/dev/null
  DATABASE_URL=$ref_url "$server_bin" migrate >"$work/migrate-reference.log" 2>&1 ||
    { cat "$work/migrate-reference.log" >&2; exit 1; }
  start_server server
  loaded_pid=$server_pid loaded_endpoint=$endpoint
  server_db_url=$ref_url start_server server-reference
  ref_pid=$server_pid ref_endpoint=$endpoint
  say "sizes: idempotencyd (pid $loaded_pid) on the growing table, (pid $ref_pid) on the reference; reaper off;" \
    "$repeats x ${seconds}s at $concurrency callers per size and server"
  loaded=0
  for size in $sizes; do
    if [ "$size" -gt "$loaded" ]; then
      [ -z "${disk_full:-}" ] || break
      want=$((size - loaded))
      say "loading $want live rows (table: $loaded -> $size)"
      read -r got load_s < <(load_rows "$want" 7200 86400)
      [ -n "${load_s:-}" ] || { say "the load failed"; exit 1; }
      say "  VACUUM (ANALYZE)"
      t0=$(date +%s)
      sql "VACUUM (ANALYZE) idempotency_records"
      note "{\"event\": \"load\", \"to_rows\": $((loaded + got)), \"rows\": $got, \"seconds\": $load_s, \"vacuum_seconds\": $(($(date +%s) - t0))}"
      loaded=$((loaded + got))
      if [ "$got" -lt "$want" ]; then disk_full=1 size=$loaded; say "  measuring at $loaded rows instead"; fi
    fi
    # One untimed run each: the pools connected, the statements prepared on these tables.
    for ep in "$loaded_endpoint" "$ref_endpoint"; do
      "$bench_bin" --endpoint "$ep" --scenario new-keys --concurrency "$concurrency" --duration 3s \
        --warmup 0s --uuid-keys --subjects "$subjects" --json >/dev/null
    done
    sql "CHECKPOINT"
    reset_stats
    for rep in $(seq "$repeats"); do
      if ((rep % 2)); then order="reference sizes"; else order="sizes reference"; fi
      for which in $order; do
        if [ "$which" = sizes ]; then server_pid=$loaded_pid endpoint=$loaded_endpoint; else server_pid=$ref_pid endpoint=$ref_endpoint; fi
        sql "CHECKPOINT"
        measure "$which" "$size" --duration "${seconds}s"
      done
    done
    note "{\"event\": \"snapshot\", \"size\": $size, \"state\": $(snapshot)}"
    note "{\"event\": \"reference\", \"size\": $size, \"rows\": $(DATABASE_URL=$ref_url sql "SELECT count(*) FROM idempotency_records")}"
    # The plan and buffers of a new key's insert, on this table.
    sql "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)
         INSERT INTO idempotency_records (namespace, operation, subject, key, state, fingerprint,
           fencing_token, created_at, expires_at, lease_expires_at)
         VALUES ('bench', 'POST /bench', 'user-7', gen_random_uuid()::text, 'in_progress', '\\x00',
           idempotency_lifetime_token(), now(), now() + interval '1 day', now() + interval '1 minute')
         ON CONFLICT DO NOTHING" >"$work/explain.json"
    note "{\"event\": \"explain_insert\", \"size\": $size, \"plan\": $(cat "$work/explain.json")}"
  done
  server_pid=$ref_pid
  stop_server
  server_pid=$loaded_pid
  stop_server
fi

# --------------------------------------------------------------- reaper --
half_rate=
if part reaper || part soak; then
  start_server server-reaper-off --reaper-enabled false
fi
if { part reaper || part soak; } && [ -n "${REAPER_RATE:-}" ]; then
  # A rate given, to compare runs of other reaper settings at the same pace.
  half_rate=$REAPER_RATE
  say "the paced runs go at $half_rate/s (REAPER_RATE; the maximum not measured)"
  note "{\"event\": \"rates\", \"max\": null, \"paced\": $half_rate, \"share_percent\": null}"
elif part reaper || part soak; then
  say "reaper: the maximum rate first ($repeats x ${seconds}s at $concurrency callers)"
  for rep in $(seq "$repeats"); do
    sql "CHECKPOINT"
    measure max max --duration "${seconds}s"
  done
  max_rate=$(report median-rate "$raw" max)
  half_rate=$((max_rate * load_share / 100))
  say "maximum $max_rate pairs/s; the paced runs go at $half_rate/s ($load_share %)"
  note "{\"event\": \"rates\", \"max\": $max_rate, \"paced\": $half_rate, \"share_percent\": $load_share}"
fi
if part reaper; then
  say "loading a backlog of $backlog expired rows"
  read -r backlog load_s < <(load_rows "$backlog" -86400 -60)
  [ -n "${load_s:-}" ] || { say "the load failed"; exit 1; }
  sql "VACUUM (ANALYZE) idempotency_records"
  note "{\"event\": \"load\", \"to_rows\": $backlog, \"rows\": $backlog, \"seconds\": $load_s, \"expired\": true}"
  note "{\"event\": \"snapshot\", \"size\": \"backlog\", \"state\": $(snapshot)}"
  for rep in $(seq "$repeats"); do
    sql "CHECKPOINT"
    measure reaper idle-before --rate "$half_rate" --duration "${seconds}s"
  done
  # The documented way to run the reaper apart from the serving pods:
  # `idempotencyd reap` every --reaper-interval, its defaults unless REAPER_ARGS.
  # shellcheck disable=SC2086
  "$server_bin" reap --log-format json $reaper_args >"$work/reap.log" 2>&1 &
  reap_pid=$!
  pids="$pids $reap_pid"
  reap_started=$(date +%s.%N)
  sql "CHECKPOINT"
  rep=0
  while :; do
    left=$(sql "SELECT count(*) FROM idempotency_records WHERE expires_at <= now()")
    [ "$left" -gt $((backlog / 100)) ] || break
    kill -0 "$reap_pid" 2>/dev/null || { say "the reaper exited; its log:"; cat "$work/reap.log" >&2; exit 1; }
    rep=$((rep + 1))
    measure reaper reaping --rate "$half_rate" --duration "${seconds}s"
  done
  while [ "$(sql "SELECT count(*) FROM idempotency_records WHERE expires_at <= now()")" -gt 0 ]; do sleep 1; done
  reap_done=$(date +%s.%N)
  kill -TERM "$reap_pid" 2>/dev/null || true
  wait "$reap_pid" 2>/dev/null || true
  note "{\"event\": \"reaped\", \"rows\": $backlog, \"seconds\": $(python3 -c "print(round($reap_done - $reap_started, 1))"), \"runs\": $(report reaper-runs "$work/reap.log")}"
  note "{\"event\": \"snapshot\", \"size\": \"reaped\", \"state\": $(snapshot)}"
  for rep in $(seq "$repeats"); do
    sql "CHECKPOINT"
    measure reaper idle-after --rate "$half_rate" --duration "${seconds}s"
  done
fi
if part reaper || part soak; then stop_server; fi

# ----------------------------------------------------------------- soak --
if part soak; then
  sql "TRUNCATE idempotency_records"
  sql "VACUUM (ANALYZE) idempotency_records"
  # The server's own reaper, at its defaults (first run at once, then every
  # --reaper-interval), unless BENCH_SERVER_ARGS says otherwise.
  start_server server-soak
  samples="$out_dir/scale-$stamp.soak.jsonl"
  : >"$samples"
  sampler() {
    local t0 now
    t0=$(date +%s.%N)
    while :; do
      now=$(python3 -c "import time; print(round(time.time() - $t0, 1))")
      sql "SELECT json_build_object('t', $now,
             'total_bytes', pg_total_relation_size('idempotency_records'),
             'heap_bytes', pg_relation_size('idempotency_records'),
             'index_bytes', pg_indexes_size('idempotency_records'),
             'rows', (SELECT count(*) FROM idempotency_records),
             'expired_rows', (SELECT count(*) FROM idempotency_records WHERE expires_at <= now()),
             'n_live_tup', n_live_tup, 'n_dead_tup', n_dead_tup,
             'autovacuum_count', autovacuum_count, 'n_tup_del', n_tup_del)
           FROM pg_stat_user_tables WHERE relname = 'idempotency_records'" >>"$samples" || true
      sleep "$soak_sample"
    done
  }
  sampler &
  sampler_pid=$!
  pids="$pids $sampler_pid"
  say "soak: ${soak_seconds}s at $half_rate new keys/s with a TTL of $soak_ttl; the server's reaper at its defaults"
  measure soak soak --rate "$half_rate" --ttl "$soak_ttl" --duration "${soak_seconds}s"
  sleep 1
  kill "$sampler_pid" 2>/dev/null || true
  wait "$sampler_pid" 2>/dev/null || true
  note "{\"event\": \"soak\", \"rate\": $half_rate, \"ttl\": \"$soak_ttl\", \"sample_seconds\": $soak_sample, \"reaper_runs\": $(report reaper-runs "$work/server-soak.log"), \"samples\": [$(paste -sd, "$samples")]}"
  stop_server
fi

commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ -n "$(git status --porcelain -- server client bench migrations scripts 2>/dev/null)" ]; then commit="$commit+dirty"; fi
settings=$(python3 -c '
import json, sys
a = sys.argv[1:]
print(json.dumps({"timestamp": a[0], "git_commit": a[1], "postgres": json.loads(a[2]),
  "pg_options": a[3], "parts": a[4].split(), "seconds": int(a[5]), "repeats": int(a[6]),
  "concurrency": int(a[7]), "sizes": [int(s) for s in a[8].split()], "subjects": int(a[9]),
  "payload_bytes": int(a[10]), "reaper_backlog": int(a[11]), "reaper_load_percent": int(a[12]),
  "reaper_args": a[13], "soak_seconds": int(a[14]), "soak_ttl": a[15], "server_args": a[16],
  "statistic": "median of repeats"}))' "$stamp" "$commit" "$pg_settings" "${PG_OPTIONS:-}" "$parts" \
  "$seconds" "$repeats" "$concurrency" "$sizes" "$subjects" "$payload" "$backlog" "$load_share" \
  "$reaper_args" "$soak_seconds" "$soak_ttl" "$server_args")
report summary "$raw" "$meta_file" "$out_dir/scale-$stamp" "$settings"
