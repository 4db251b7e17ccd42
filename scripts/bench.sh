#!/usr/bin/env bash
# `make bench`: the service against hand-written SQL on the same table and the
# same Postgres, at production durability (fsync=on, synchronous_commit=on).
#
# In one run, for each concurrency C in BENCH_CONCURRENCY (default "1 16 64 256"):
#   new keys: pgbench bench/pgbench/new_key_pair.sql (INSERT ... ON CONFLICT DO
#             NOTHING, then UPDATE to completed: one "pair") against
#             idempotency-bench --scenario new-keys (Acquire, then Complete),
#             and the durable ceiling: pgbench bench/pgbench/ceiling_pair.sql,
#             the same insert and update as multi-row statements of
#             BENCH_CEILING_KEYS (32) keys, BENCH_CEILING_CLIENTS (8) clients,
#             in keys/s (the most this Postgres does with these rows; a
#             statement's keys spread over the index as the service's are),
#             and at the highest concurrency also the ceiling as it was
#             until 2026-12-06 (ceiling_pair_adjacent.sql: a statement's
#             keys adjacent in the index), first or last by repetition;
#   replay:   pgbench bench/pgbench/replay.sql (a primary-key SELECT) against
#             idempotency-bench --scenario replay (Acquire of a completed key),
#             on the server as configured (replay cache on: hits from memory)
#             and on a second server with --replay-cache-bytes 0 (row
#             "replay-db": every replay reads Postgres).
# Then the memory of calls in flight: a server started for it alone, with
# BENCH_MEMORY_CALLS (1000) new-key callers (no client batching, 16 gRPC
# connections: the server takes 100 streams on each), and the table locked
# for 2 s midway so that their calls pile up inside the server, as behind a
# stalled database: its peak RSS (VmHWM) and the most calls in flight it
# reported.
# Then, for each concurrency in BENCH_AUTH_CONCURRENCY (default "64"), the
# cost of TLS and auth: new keys through four servers, interleaved (the
# order reversed every other repetition): "off" (plaintext, no auth, as above),
# "tls" (TLS, no auth), "jwt" (TLS, and an RS256 JWT shaped like a
# Kubernetes service-account token on every RPC, checked against a JWKS)
# and "static" (TLS and a static token); BENCH_AUTH_VARIANTS picks among
# them. The certificates, keys, tokens and policy are made by
# `idempotency-bench --make-auth-files target/bench/auth` (key and token
# files mode 0600; only their paths reach any command line).
# Each measurement runs BENCH_SECONDS (default 10) and is repeated
# BENCH_REPEATS times (default 3), pgbench and service interleaved; the table
# shows medians. Results: target/bench/results-<timestamp>.{json,md}.
# BENCH_ONLY picks parts: any of "new-keys replay memory auth" (default: all);
# BENCH_AUTH=0 leaves the auth part out.
#
# BENCH_SERVER_THREADS (default 1) is the server's --worker-threads: on this
# two-CPU machine the server shares the CPUs with Postgres and the load
# generator, and gets about a third of one (0: the server's own default, one
# thread per CPU). The load generator runs one thread too (its --threads).
# BENCH_SERVER_ARGS adds flags to `idempotencyd serve` (e.g. "--batching false"),
# BENCH_CLIENT_ARGS to the load generator (e.g. "--no-batching": every call its
# own RPC, as a client without the batch RPCs would send them).
# Other knobs: BENCH_WARMUP (service only, default 2s), BENCH_PAYLOAD_BYTES
# (256), BENCH_KEYS (replay keys, 1000), BENCH_CONNECTIONS (gRPC, 1), and
# BENCH_WAIT_QUIET=N: before each measurement, wait up to N seconds until
# other work on the machine (builds, tests) uses under 15 % of the CPUs
# (default 0: measure at once; the "other load" column shows what it was).
#
# Always a throwaway cluster (DATABASE_URL is ignored: the run writes about 2.5
# million rows). Everything listens on 127.0.0.1 only.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf 'bench: %s\n' "$*" >&2; }

if [ -z "${BENCH_INNER:-}" ]; then
  command -v python3 >/dev/null || { say "python3 is needed for the percentiles and the table"; exit 1; }
  started=$(date +%s)
  say "building release binaries"
  cargo build --release --locked -p idempotency-server -p idempotency-bench
  status=0
  env -u DATABASE_URL BENCH_INNER=1 PG_FSYNC=on scripts/with-postgres.sh "$0" "$@" || status=$?
  say "make bench took $(($(date +%s) - started)) s"
  exit "$status"
fi

# ---- inside scripts/with-postgres.sh: DATABASE_URL is the throwaway cluster ----

# The pgbench scripts' keys take a region per run from pgbench's random_seed,
# new every run unless this fixes it (then a run would find its keys taken).
unset PGBENCH_RANDOM_SEED
seconds=${BENCH_SECONDS:-10}
repeats=${BENCH_REPEATS:-3}
concurrencies=${BENCH_CONCURRENCY:-1 16 64 256}
ceiling_keys=${BENCH_CEILING_KEYS:-32}
ceiling_clients=${BENCH_CEILING_CLIENTS:-8}
memory_calls=${BENCH_MEMORY_CALLS:-1000}
warmup=${BENCH_WARMUP:-2s}
payload=${BENCH_PAYLOAD_BYTES:-256}
keys=${BENCH_KEYS:-1000}
connections=${BENCH_CONNECTIONS:-1}
wait_quiet=${BENCH_WAIT_QUIET:-0}
auth_concurrencies=${BENCH_AUTH_CONCURRENCY:-64}
auth_variants=${BENCH_AUTH_VARIANTS:-off tls jwt static}
only=${BENCH_ONLY:-new-keys replay memory auth}
if [ "${BENCH_AUTH:-1}" = 0 ]; then only=${only//auth/}; fi
for name in $only; do
  case $name in new-keys | replay | memory | auth) ;; *) say "BENCH_ONLY: unknown part $name (new-keys, replay, memory, auth)"; exit 1 ;; esac
done
for variant in $auth_variants; do
  case $variant in off | tls | jwt | static) ;; *) say "BENCH_AUTH_VARIANTS: unknown $variant (off, tls, jwt, static)"; exit 1 ;; esac
done
part() { [[ " $only " == *" $1 "* ]]; }
server_bin=target/release/idempotencyd
bench_bin=target/release/idempotency-bench
report() { python3 bench/report.py "$@"; }

# shellcheck source=scripts/pg-client.sh
. scripts/pg-client.sh

stamp=$(date -u +%Y%m%dT%H%M%SZ)
out_dir=target/bench
mkdir -p "$out_dir"
work=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-bench.XXXXXX")
raw="$work/raw.jsonl"
: >"$raw"

server_pids=
cleanup() {
  local pid
  for pid in $server_pids; do
    kill -0 "$pid" 2>/dev/null || continue
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Production durability, checked rather than assumed.
fsync=$(sql "SHOW fsync")
sync_commit=$(sql "SHOW synchronous_commit")
say "fsync=$fsync synchronous_commit=$sync_commit wal_sync_method=$(sql 'SHOW wal_sync_method')" \
  "shared_buffers=$(sql 'SHOW shared_buffers') max_connections=$(sql 'SHOW max_connections')"
if [ "$fsync" != on ] || [ "$sync_commit" != on ]; then
  say "refusing to measure without fsync=on and synchronous_commit=on"
  exit 1
fi
pg_version=$(sql "SHOW server_version")
postmaster_pid=$(head -n 1 "$(sql 'SHOW data_directory')/postmaster.pid")

"$server_bin" migrate >"$work/migrate.log" 2>&1 || { cat "$work/migrate.log" >&2; exit 1; }

# The keys pgbench's replay.sql reads, stored the way the service stores them.
"$psql" -X -q -v ON_ERROR_STOP=1 -v keys="$keys" -v payload="$payload" -f bench/pgbench/replay_keys.sql "$DATABASE_URL" >/dev/null
# Statistics from the start, as autovacuum gives a table within its first
# minute: before any, the ceiling's prepared UPDATE (its keys an array)
# ran at a twentieth of its speed in the first two runs. The service's own
# plans are guarded without them (server/src/store/mod.rs, "Plans").
sql "ANALYZE idempotency_records"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# The server measured: the default one, or the one without the replay cache.
use_server() { server_pid=$1 endpoint=$2; }

start_server() { # extra serve flags...; sets started_pid, started_endpoint, started_metrics_port
  local grpc_port metrics_port log="$work/server-$((++servers)).log" scheme=http
  [[ " $* " == *" --tls-cert "* ]] && scheme=https
  grpc_port=$(free_port)
  metrics_port=$(free_port)
  while [ "$metrics_port" = "$grpc_port" ]; do metrics_port=$(free_port); done
  "$server_bin" serve --grpc-addr "127.0.0.1:$grpc_port" --metrics-addr "127.0.0.1:$metrics_port" \
    --reaper-enabled false --drain-timeout 5s "$@" >"$log" 2>&1 &
  started_pid=$!
  server_pids="$server_pids $started_pid"
  for _ in $(seq 100); do
    kill -0 "$started_pid" 2>/dev/null || { say "the server exited; its log:"; cat "$log" >&2; exit 1; }
    (exec 3<>"/dev/tcp/127.0.0.1/$grpc_port") 2>/dev/null && break
    sleep 0.1
  done
  started_endpoint="$scheme://127.0.0.1:$grpc_port" started_metrics_port=$metrics_port
  metrics_port_of[$started_pid]=$metrics_port
}
declare -A metrics_port_of
servers=0
server_threads=${BENCH_SERVER_THREADS:-1}
server_args="${BENCH_SERVER_ARGS:-}"
if [ "$server_threads" != 0 ]; then server_args="--worker-threads $server_threads $server_args"; fi
if part new-keys || part replay; then
  # shellcheck disable=SC2086 # server_args is a list of flags
  start_server $server_args
  cached_pid=$started_pid cached_endpoint=$started_endpoint
  use_server "$cached_pid" "$cached_endpoint"
  say "idempotencyd (pid $server_pid, release) on $endpoint; settings at their defaults${server_args:+ except $server_args}"
fi
if part replay; then
  # A second server on the same database, without the replay cache, so that
  # replays are also measured reading Postgres every time.
  # shellcheck disable=SC2086
  start_server $server_args --replay-cache-bytes 0
  uncached_pid=$started_pid uncached_endpoint=$started_endpoint
  say "idempotencyd (pid $uncached_pid) on $uncached_endpoint with --replay-cache-bytes 0"
fi

ticks() { report ticks "$postmaster_pid" "$server_pid" "$$"; }
vmhwm_kb() { awk '/^VmHWM:/ { print $2 }' "/proc/$server_pid/status"; }
wal_lsn() { sql "SELECT pg_current_wal_insert_lsn()"; }
wal_since() { sql "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '$1')::bigint"; }

# Before each measurement: with vacuum_first=1 a VACUUM (the new-keys and
# auth parts, see there), a checkpoint (none falls due mid-run), then, with
# BENCH_WAIT_QUIET, a wait for other work on the machine to calm down.
vacuum_first=0
settle() {
  if [ "$vacuum_first" = 1 ]; then sql "VACUUM idempotency_records" >/dev/null; fi
  sql "CHECKPOINT" >/dev/null
  [ "$wait_quiet" -gt 0 ] || return 0
  local waited=0 before other
  while :; do
    before=$(ticks); sleep 2
    other=$(report other "$before" "$(ticks)")
    python3 -c "import sys; sys.exit(0 if $other < 0.15 else 1)" && return 0
    [ "$waited" -ge "$wait_quiet" ] && { say "still $other of the CPUs busy with other work; measuring anyway"; return 0; }
    [ "$waited" = 0 ] && say "other work uses $other of the CPUs; waiting up to ${wait_quiet}s"
    waited=$((waited + 2))
  done
}

run_pgbench() { # scenario script concurrency rep extra-args...
  local scenario=$1 script=$2 c=$3 rep=$4
  shift 4
  # The ceiling runs its own number of clients; its record keeps the row's
  # concurrency, to pair it with the runs beside it.
  local clients=$c keys=1 prefix="$work/pgb-$scenario-$c-$rep" before lsn
  if [[ $scenario == ceiling* ]]; then clients=$ceiling_clients keys=$ceiling_keys; fi
  settle
  lsn=$(wal_lsn)
  before=$(ticks)
  # The ceiling's UPDATE takes its keys as an array: on a table without
  # statistics yet its generic plan would scan the table, as the service's
  # would without the guards its sessions have (index lookups only).
  local options=${PGOPTIONS:-}
  if [[ $scenario == ceiling* ]]; then options="$options -c enable_seqscan=off"; fi
  PGOPTIONS=$options "$pgbench" -M prepared -n -c "$clients" -j 2 -T "$seconds" -f "$script" "$@" \
    --log --log-prefix="$prefix" "$DATABASE_URL" >"$prefix.out" 2>"$prefix.err" ||
    { cat "$prefix.out" "$prefix.err" >&2; exit 1; }
  report pgbench "$scenario" "$c" "$rep" "$prefix" "$before" "$(ticks)" "$(wal_since "$lsn")" \
    "$clients" "$keys" >>"$raw"
  rm -f "$prefix".*
  report progress "$raw"
}

run_service() { # scenario label concurrency rep extra-args...
  local scenario=$1 label=$2 c=$3 rep=$4
  shift 4
  local conns=$((c < connections ? c : connections)) before lsn statements
  settle
  # The server's batch statements and their calls so far: the record keeps
  # the calls per statement of this run (at 16 callers, whether the callers
  # moved as one group or split into groups taking turns).
  statements=$(report statements "${metrics_port_of[$server_pid]:-0}")
  lsn=$(wal_lsn)
  before=$(ticks)
  "$bench_bin" --endpoint "$endpoint" --scenario "$scenario" --concurrency "$c" \
    --connections "$conns" --duration "${seconds}s" --warmup "$warmup" \
    --payload-bytes "$payload" --keys "$keys" --server-pid "$server_pid" --json "$@" \
    ${BENCH_CLIENT_ARGS:-} >"$work/service.json" 2>"$work/service.err" ||
    { cat "$work/service.err" >&2; exit 1; }
  if [ -s "$work/service.err" ]; then sed 's/^/  /' "$work/service.err" >&2; fi
  kill -0 "$server_pid" 2>/dev/null || { say "the server died; its logs:"; cat "$work"/server-*.log >&2; exit 1; }
  report service "$label" "$c" "$rep" "$work/service.json" "$before" "$(ticks)" \
    "$(wal_since "$lsn")" "$(vmhwm_kb)" "" "$statements" \
    "$(report statements "${metrics_port_of[$server_pid]:-0}")" >>"$raw"
  report progress "$raw"
}

say "$repeats x ${seconds}s per measurement; parts: $only; concurrency: $concurrencies, auth $auth_concurrencies"
if part new-keys; then
  # No autovacuum here either, a VACUUM before each measurement instead (as
  # in the auth part below). Each of the ceiling's runs updates some 600,000
  # rows, so an autovacuum fell due every measurement or two and landed on
  # whichever ran then, often the service's run right after the ceiling's:
  # in the nineteenth run (docs/performance.md) the service's repetitions that
  # wrote 10-52 kB of WAL per pair instead of about 1 kB were the slowest of
  # their rows.
  sql "ALTER TABLE idempotency_records SET (autovacuum_enabled = false)"
  vacuum_first=1
  # The old ceiling (its keys adjacent) at the highest concurrency: first in
  # odd repetitions, last in even ones, so that neither ceiling always runs
  # on the smaller table.
  highest=$(printf '%s\n' $concurrencies | sort -n | tail -n 1)
  adjacent_ceiling() {
    run_pgbench ceiling-adjacent bench/pgbench/ceiling_pair_adjacent.sql "$c" "$rep" \
      -D "payload=$payload" -D "keys=$ceiling_keys"
  }
  for c in $concurrencies; do
    for rep in $(seq "$repeats"); do
      if [ "$c" = "$highest" ] && [ $((rep % 2)) = 1 ]; then adjacent_ceiling; fi
      run_pgbench new-keys bench/pgbench/new_key_pair.sql "$c" "$rep" -D "payload=$payload"
      run_pgbench ceiling bench/pgbench/ceiling_pair.sql "$c" "$rep" -D "payload=$payload" \
        -D "keys=$ceiling_keys"
      run_service new-keys new-keys "$c" "$rep"
      if [ "$c" = "$highest" ] && [ $((rep % 2)) = 0 ]; then adjacent_ceiling; fi
    done
  done
  vacuum_first=0
  sql "ALTER TABLE idempotency_records RESET (autovacuum_enabled)"
fi
if part replay; then
  # Vacuum now, so that autovacuum does not pick the replay runs to clean up
  # after the new keys; then the service's replay keys, completed once through the service (as pgbench's
  # were inserted once above), so the timed runs only read.
  use_server "$cached_pid" "$cached_endpoint"
  "$bench_bin" --endpoint "$endpoint" --scenario replay --concurrency 1 --connections 1 --count 1 \
    --warmup 0s --payload-bytes "$payload" --keys "$keys" --key-prefix bench-replay --json >/dev/null
  sql "VACUUM (ANALYZE) idempotency_records"
  for c in $concurrencies; do
    for rep in $(seq "$repeats"); do
      run_pgbench replay bench/pgbench/replay.sql "$c" "$rep" -D "keys=$keys"
      use_server "$cached_pid" "$cached_endpoint"
      run_service replay replay "$c" "$rep" --key-prefix bench-replay --skip-prepare
      use_server "$uncached_pid" "$uncached_endpoint"
      run_service replay replay-db "$c" "$rep" --key-prefix bench-replay --skip-prepare
    done
  done
fi

# Memory per call in flight: a server of its own (so that its peak RSS is
# this part's), BENCH_MEMORY_CALLS callers without client batching, each
# call its own RPC, over 16 connections (100 streams each), for 6 s. Running
# freely, most of them wait in the sockets, not in the server (its one thread
# is busy): so the table is locked from 2 s to 4 s, and every caller's call
# is then held by the server, read and decoded, waiting for the database.
# The server's in-flight gauge is sampled meanwhile, so the table shows how
# many calls it really held at once.
if part memory; then
  # shellcheck disable=SC2086
  start_server $server_args
  memory_pid=$started_pid memory_endpoint=$started_endpoint
  memory_metrics_port=$started_metrics_port
  say "memory: idempotencyd (pid $memory_pid) on $memory_endpoint, $memory_calls calls in flight"
  peak_file="$work/in-flight-peak"
  echo 0 >"$peak_file"
  (
    peak=0
    while kill -0 "$memory_pid" 2>/dev/null; do
      now=$(python3 - "$memory_metrics_port" <<'PY' 2>/dev/null || echo 0
import sys, urllib.request
page = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=1).read().decode()
print(int(sum(float(l.split()[-1]) for l in page.splitlines()
              if l.startswith("idempotency_grpc_calls_in_flight"))))
PY
)
      if [ "$now" -gt "$peak" ]; then peak=$now; echo "$peak" >"$peak_file"; fi
      sleep 0.2
    done
  ) &
  sampler=$!
  use_server "$memory_pid" "$memory_endpoint"
  lsn=$(wal_lsn)
  before=$(ticks)
  (
    sleep 3 # 1 s of warm-up, then 2 s
    "$psql" -X -q -v ON_ERROR_STOP=1 "$DATABASE_URL" \
      -c "BEGIN" -c "LOCK TABLE idempotency_records IN SHARE ROW EXCLUSIVE MODE" \
      -c "SELECT pg_sleep(2)" -c "COMMIT" >/dev/null
  ) &
  stall=$!
  "$bench_bin" --endpoint "$endpoint" --scenario new-keys --concurrency "$memory_calls" \
    --connections 16 --no-batching --duration 6s --warmup 1s \
    --payload-bytes "$payload" --server-pid "$server_pid" --json >"$work/service.json" 2>"$work/service.err" ||
    { cat "$work/service.err" >&2; exit 1; }
  report service memory "$memory_calls" 1 "$work/service.json" "$before" "$(ticks)" \
    "$(wal_since "$lsn")" "$(vmhwm_kb)" "$(cat "$peak_file")" >>"$raw"
  report progress "$raw"
  wait "$stall"
  kill "$sampler" 2>/dev/null || true
  wait "$sampler" 2>/dev/null || true
fi

# The cost of TLS and auth: the same new-key pairs through a server with
# each of them on. Last, so that the rows these runs add (about 100k per
# measurement at 64 callers) do not change the table the parts above see.
auth_files='{}'
if part auth; then
  auth_dir=$out_dir/auth
  issuer=https://kubernetes.default.svc.cluster.local audience=idempotency
  auth_files=$("$bench_bin" --make-auth-files "$auth_dir" --namespace bench \
    --jwt-issuer "$issuer" --jwt-audience "$audience")
  declare -A auth_pid auth_endpoint auth_client
  tls_flags="--tls-cert $auth_dir/tls.crt --tls-key $auth_dir/tls.key"
  for variant in $auth_variants; do
    case $variant in
      off) flags= client= ;;
      tls) flags=$tls_flags client="--tls-ca $auth_dir/ca.crt" ;;
      jwt)
        flags="$tls_flags --jwt-jwks $auth_dir/jwks.json --jwt-issuer $issuer --jwt-audience $audience"
        flags="$flags --auth-policy $auth_dir/policy.toml"
        client="--tls-ca $auth_dir/ca.crt --bearer-token-file $auth_dir/jwt.token" ;;
      static)
        flags="$tls_flags --static-tokens $auth_dir/tokens.toml --auth-policy $auth_dir/policy.toml"
        client="--tls-ca $auth_dir/ca.crt --bearer-token-file $auth_dir/static.token" ;;
    esac
    # shellcheck disable=SC2086 # lists of flags
    start_server $server_args $flags
    auth_pid[$variant]=$started_pid auth_endpoint[$variant]=$started_endpoint auth_client[$variant]=$client
    say "auth $variant: idempotencyd (pid $started_pid) on $started_endpoint${flags:+ with $flags}"
  done
  # An untimed run through each server: its pool connected, its caches
  # warm, the cluster past its first minute when this part runs alone (a
  # fresh cluster is slower at first), and a variant that refuses calls
  # stops the run here.
  for variant in $auth_variants; do
    # shellcheck disable=SC2086
    "$bench_bin" --endpoint "${auth_endpoint[$variant]}" --scenario new-keys \
      --concurrency "${auth_concurrencies%% *}" --duration 5s --warmup 0s \
      --payload-bytes "$payload" --json ${auth_client[$variant]} ${BENCH_CLIENT_ARGS:-} \
      >"$work/auth-check.json" 2>"$work/auth-check.err" || { cat "$work/auth-check.err" >&2; exit 1; }
    if ! python3 -c 'import json, sys; sys.exit(1 if json.load(open(sys.argv[1]))["errors_total"] else 0)' \
      "$work/auth-check.json"; then
      say "auth $variant: calls failed:"
      cat "$work/auth-check.err" "$work/auth-check.json" >&2
      exit 1
    fi
  done
  # No autovacuum in this part, a VACUUM before each measurement instead:
  # an autovacuum that starts mid-measurement (after about 20 % new rows,
  # every measurement or two here) dirties some 100 MB within a second, and
  # on this machine's disk the commits queued behind its writeback stalled
  # for seconds: that measurement fell to a tenth, whatever its variant.
  sql "ALTER TABLE idempotency_records SET (autovacuum_enabled = false)"
  sql "VACUUM (ANALYZE) idempotency_records"
  vacuum_first=1
  read -r -a variants <<<"$auth_variants"
  for c in $auth_concurrencies; do
    for rep in $(seq "$repeats"); do
      # Forwards, then backwards (off tls jwt static, static jwt tls off,
      # ...): over two repetitions every variant's mean place is the same,
      # so a drift of the machine or of the growing table cancels out.
      for i in "${!variants[@]}"; do
        if ((rep % 2)); then variant=${variants[$i]}; else variant=${variants[$((${#variants[@]} - 1 - i))]}; fi
        use_server "${auth_pid[$variant]}" "${auth_endpoint[$variant]}"
        # shellcheck disable=SC2086
        run_service new-keys "auth-$variant" "$c" "$rep" ${auth_client[$variant]}
      done
    done
  done
  vacuum_first=0
  sql "ALTER TABLE idempotency_records RESET (autovacuum_enabled)"
fi

rows=$(sql "SELECT count(*) FROM idempotency_records")
say "done; the table holds $rows rows"

commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ -n "$(git status --porcelain -- server client bench migrations 2>/dev/null)" ]; then commit="$commit+dirty"; fi
meta=$(python3 -c '
import json, sys
a = sys.argv[1:]
print(json.dumps({
    "timestamp": a[0], "git_commit": a[1],
    "postgres": {"version": a[2], "fsync": a[3], "synchronous_commit": a[4]},
    "settings": {"seconds": int(a[5]), "repeats": int(a[6]), "warmup": a[7], "payload_bytes": int(a[8]),
                 "replay_keys": int(a[9]), "grpc_connections": int(a[10]), "wait_quiet": int(a[11]),
                 "pgbench": "-M prepared -n -j 2 -c C -T " + a[5], "statistic": "median of repeats",
                 "server": "idempotencyd serve, defaults (db pool 16), --reaper-enabled false " + a[13],
                 "load_generator": "one client per gRPC connection, one runtime thread, client defaults " + a[14],
                 "parts": a[15].split(), "concurrency": [int(c) for c in a[16].split()],
                 "auth": {"concurrency": [int(c) for c in a[17].split()], "variants": a[18].split(),
                          "files": json.loads(a[19])}},
    "final_table_rows": int(a[12]),
}))' "$stamp" "$commit" "$pg_version" "$fsync" "$sync_commit" "$seconds" "$repeats" "$warmup" \
  "$payload" "$keys" "$connections" "$wait_quiet" "$rows" "$server_args" "${BENCH_CLIENT_ARGS:-}" \
  "$only" "$concurrencies" "$auth_concurrencies" "$auth_variants" "$auth_files")
report summary "$raw" "$out_dir/results-$stamp" "$meta"
