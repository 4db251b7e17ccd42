#!/usr/bin/env bash
# `make bench-floor`: the server against the floor of a batching gRPC service,
# at FLOOR_CONCURRENCY callers (default "16 256"), on one throwaway Postgres
# (fsync on). In each round, one after the other (the order rotated every
# round and reversed every other round, so that no service always runs right
# after another as the table grows; a VACUUM before each, autovacuum off, as
# in make bench):
#   pgbench  pgbench's new-key pair (bench/pgbench/new_key_pair.sql), C clients;
#   ceiling  the durable ceiling (bench/pgbench/ceiling_pair.sql), 8 clients of
#            32 keys, as make bench runs it;
#   floor    `idempotency-bench --serve-floor`: tonic and sqlx alone, each
#            batch RPC one multi-row statement in the ceiling's shape;
#   floor-service  the same floor running the server's own two batch
#            statements (--floor-statements service), bound as the server binds them;
#   server   idempotencyd with one worker thread and the reaper off.
# The three services are loaded by the load generator (one thread, the client
# library, which batches) with new-key pairs at C callers.
# What the floor reaches is what any gRPC service in Rust over these
# statements reaches here; the floor with the server's statements against the
# floor is the price of the statements' shape, the server against the floor
# with its statements is the price of everything else the server does
# (docs/performance.md, "The server against the floor of a batching service").
#
# FLOOR_CONCURRENCY, FLOOR_ROUNDS (4), BENCH_SECONDS (4). Prints each round's
# pairs/s, the ratios, and the server CPU per pair of each service. A run with
# any error (a call the load generator saw fail, a pgbench that failed) stops.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf 'bench-floor: %s\n' "$*" >&2; }

if [ -z "${FLOOR_INNER:-}" ]; then
  cargo build --release --locked -p idempotency-server -p idempotency-bench
  exec env -u DATABASE_URL FLOOR_INNER=1 PG_FSYNC=on scripts/with-postgres.sh "$0" "$@"
fi

# pgbench's scripts take a region of keys per run from its random_seed.
unset PGBENCH_RANDOM_SEED
seconds=${BENCH_SECONDS:-4}
rounds=${FLOOR_ROUNDS:-4}
concurrencies=${FLOOR_CONCURRENCY:-16 256}
server_bin=target/release/idempotencyd
bench_bin=target/release/idempotency-bench
# shellcheck source=scripts/pg-client.sh
. scripts/pg-client.sh
work=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-floor.XXXXXX")
pids=""
trap 'kill $pids 2>/dev/null; rm -rf "$work"' EXIT

# shellcheck source=scripts/bench-ports.sh
. scripts/bench-ports.sh

"$server_bin" migrate >"$work/migrate.log" 2>&1 || { cat "$work/migrate.log" >&2; exit 1; }
# Rows and statistics from the start, as make bench has them (without
# statistics the ceiling's prepared UPDATE scans the table).
"$psql" -X -q -v ON_ERROR_STOP=1 -v keys=1000 -v payload=256 -f bench/pgbench/replay_keys.sql \
  "$DATABASE_URL" >/dev/null
sql "ANALYZE idempotency_records"
sql "ALTER TABLE idempotency_records SET (autovacuum_enabled = false)"

read -r port_server port_floor port_floor_service port_metrics < <(free_ports 4)
"$server_bin" serve --grpc-addr "127.0.0.1:$port_server" --metrics-addr "127.0.0.1:$port_metrics" \
  --reaper-enabled false --worker-threads 1 >"$work/server.log" 2>&1 &
pid_server=$!
"$bench_bin" --serve-floor "127.0.0.1:$port_floor" --serve-for 1h --threads 1 \
  >"$work/floor.log" 2>&1 &
pid_floor=$!
"$bench_bin" --serve-floor "127.0.0.1:$port_floor_service" --floor-statements service \
  --serve-for 1h --threads 1 >"$work/floor-service.log" 2>&1 &
pid_floor_service=$!
pids="$pid_server $pid_floor $pid_floor_service"
wait_port "$port_server"; wait_port "$port_floor"; wait_port "$port_floor_service"

# The serving pool's settings, for pgbench's pair as in make bench-budget.
serving_options="-c plan_cache_mode=force_generic_plan -c enable_seqscan=off -c enable_bitmapscan=off -c jit=off"

measure() { # what concurrency round: writes $work/WHAT-C-ROUND.txt (pairs/s [server CPU µs per pair])
  local what=$1 c=$2 round=$3 out=$work/$1-$2-$3.txt
  sql "VACUUM idempotency_records" >/dev/null
  case $what in
    pgbench)
      PGOPTIONS=$serving_options "$pgbench" -M prepared -n -c "$c" -j 2 -T "$seconds" \
        -f bench/pgbench/new_key_pair.sql -D payload=256 "$DATABASE_URL" \
        >"$work/pgbench.out" 2>"$work/pgbench.err" || { cat "$work/pgbench.err" >&2; exit 1; }
      awk '/^tps/ { print $3 }' "$work/pgbench.out" >"$out" ;;
    ceiling)
      PGOPTIONS="-c enable_seqscan=off" "$pgbench" -M prepared -n -c 8 -j 2 -T "$seconds" \
        -f bench/pgbench/ceiling_pair.sql -D payload=256 -D keys=32 "$DATABASE_URL" \
        >"$work/pgbench.out" 2>"$work/pgbench.err" || { cat "$work/pgbench.err" >&2; exit 1; }
      awk '/^tps/ { print $3 * 32 }' "$work/pgbench.out" >"$out" ;;
    *)
      local port=port_${what//-/_} pid=pid_${what//-/_}
      "$bench_bin" --endpoint "http://127.0.0.1:${!port}" --scenario new-keys --concurrency "$c" \
        --threads 1 --duration "${seconds}s" --warmup 1s --payload-bytes 256 \
        --server-pid "${!pid}" --json >"$work/$what.json"
      python3 -c 'import json, sys; d = json.load(open(sys.argv[1]))
failed, cpu = d["errors_total"], d["server_cpu_seconds"]
if failed: sys.exit(sys.argv[2] + ": " + str(failed) + " calls failed: " + str(d["errors"]))
if cpu is None: sys.exit(sys.argv[2] + ": its CPU time was not read")
print(d["ops_per_sec"], 1e6 * cpu / d["ops"])' "$work/$what.json" "$what" >"$out" ;;
  esac
  [ -s "$out" ] || { say "$what at $c callers measured nothing"; exit 1; }
}

order=(pgbench ceiling floor floor-service server)
say "$rounds rounds of ${seconds}s at ${concurrencies// /, } callers"
for c in $concurrencies; do
  for round in $(seq "$rounds"); do
    this=("${order[@]}")
    if [ $((round % 2)) = 0 ]; then
      this=(); for ((i = ${#order[@]} - 1; i >= 0; i--)); do this+=("${order[i]}"); done
    fi
    for what in "${this[@]}"; do measure "$what" "$c" "$round"; done
    order=("${order[@]:1}" "${order[0]}")
  done
done

python3 - "$work" "$rounds" "$concurrencies" <<'EOF'
import statistics, sys
work, rounds, concurrencies = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
def read(what, c, r):
    return [float(x) for x in open(f"{work}/{what}-{c}-{r}.txt").read().split()]
for c in concurrencies:
    print(f"\n{c} callers (new-key pairs/s; the ceiling in keys/s; CPU: the service process's µs per pair)\n")
    print("| round | pgbench | ceiling | floor | floor, the server's statements | server "
          "| floor / pgbench | floor, the server's statements / floor | server / that floor "
          "| server / pgbench | floor / ceiling | floor, the server's statements / ceiling "
          "| server / ceiling | CPU floor / its statements / server |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    cols = {k: [] for k in ("f/pg", "fs/f", "sv/fs", "sv/pg", "f/ce", "fs/ce", "sv/ce")}
    for r in range(1, rounds + 1):
        pg, ce = read("pgbench", c, r)[0], read("ceiling", c, r)[0]
        (f, fcpu), (fs, fscpu), (sv, svcpu) = (read(w, c, r) for w in ("floor", "floor-service", "server"))
        row = {"f/pg": f / pg, "fs/f": fs / f, "sv/fs": sv / fs, "sv/pg": sv / pg,
               "f/ce": f / ce, "fs/ce": fs / ce, "sv/ce": sv / ce}
        for k, v in row.items():
            cols[k].append(v)
        print(f"| {r} | {pg:,.0f} | {ce:,.0f} | {f:,.0f} | {fs:,.0f} | {sv:,.0f} | "
              + " | ".join(f"{v:.2f}" for v in row.values())
              + f" | {fcpu:.1f} / {fscpu:.1f} / {svcpu:.1f} |")
    print("| median | | | | | | " + " | ".join(f"{statistics.median(v):.2f}" for v in cols.values()) + " | |")
EOF
