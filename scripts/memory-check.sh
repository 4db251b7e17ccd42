#!/usr/bin/env bash
# `make memory-check`: the server's peak memory under the hostile inputs of
# issue 16, many at once, against the chart's memory limit. Not a test of
# speed: it reads the release server's VmHWM (peak resident set) around each
# case of `idempotency-hostile` (tests/src/bin/hostile.rs), and prints a table.
#
# The server runs with its defaults, as the chart runs it. MEMCHECK_CONCURRENCY
# (default 64) calls at once per case over MEMCHECK_CONNECTIONS (default 8)
# connections; MEMCHECK_SERVER_ARGS adds serve flags. Always a throwaway Postgres.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf 'memory-check: %s\n' "$*" >&2; }

if [ -z "${MEMCHECK_INNER:-}" ]; then
  say "building release binaries"
  cargo build --release --locked -p idempotency-server --bin idempotencyd \
    -p idempotency-tests --bin idempotency-hostile
  exec env -u DATABASE_URL MEMCHECK_INNER=1 PG_FSYNC=off scripts/with-postgres.sh "$0" "$@"
fi

concurrency=${MEMCHECK_CONCURRENCY:-64}
connections=${MEMCHECK_CONNECTIONS:-8}
limit=$(awk '/^resources:/ { r = 1 } r && /^  limits:/ { l = 1 } l && /memory:/ { print $2; exit }' \
  deploy/helm/idempotency/values.yaml)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
grpc_port=$(free_port)
metrics_port=$(free_port)
log=$(mktemp)
# shellcheck disable=SC2086 # extra flags, split on purpose
target/release/idempotencyd serve --migrate --grpc-addr "127.0.0.1:$grpc_port" \
  --metrics-addr "127.0.0.1:$metrics_port" ${MEMCHECK_SERVER_ARGS:-} >"$log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 100); do
  kill -0 "$server" 2>/dev/null || { say "the server exited:"; cat "$log" >&2; exit 1; }
  (exec 3<>"/dev/tcp/127.0.0.1/$grpc_port") 2>/dev/null && break
  sleep 0.1
done

kib() { awk -v f="$1:" '$1 == f { print $2 }' "/proc/$server/status"; }
mib() { awk -v k="$1" 'BEGIN { printf "%.0f", k / 1024 }'; }
hostile() { target/release/idempotency-hostile --endpoint "http://127.0.0.1:$grpc_port" \
  --concurrency "$concurrency" --connections "$connections" "$@"; }

# Warm up: the pool, the replay cache's first entries, the allocator.
hostile large-replies >/dev/null
start=$(kib VmRSS)
printf '\n| case (%s calls at once) | answers | peak RSS | growth |\n|---|---|---|---|\n' "$concurrency"
for case in huge-batch full-batch header-map large-replies stream-flood idle-connections; do
  echo 5 >"/proc/$server/clear_refs"
  answers=$(hostile "$case" | python3 -c 'import json,sys; print(", ".join(f"{k} {v}" for k, v in json.load(sys.stdin)["answers"].items()))')
  peak=$(kib VmHWM)
  printf '| %s | %s | %s MiB | +%s MiB |\n' "$case" "$answers" "$(mib "$peak")" "$(mib $((peak - start)))"
done
echo 5 >"/proc/$server/clear_refs"
hostile huge-batch full-batch header-map large-replies stream-flood >/dev/null &
first=$!
hostile large-replies huge-batch header-map full-batch >/dev/null &
second=$!
wait "$first" "$second"
peak=$(kib VmHWM)
printf '| all of them, twice over, at once | | %s MiB | +%s MiB |\n' "$(mib "$peak")" "$(mib $((peak - start)))"
printf '\nRSS after warm-up %s MiB; the chart limits the pod to %s.\n' "$(mib "$start")" "$limit"
