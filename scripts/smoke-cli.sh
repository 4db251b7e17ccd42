#!/usr/bin/env bash
# The binary's own commands against DATABASE_URL: migrate, reap --once,
# admin. The Rust tests cover the logic behind them; this checks the wiring
# (flags, environment, exit codes, output) of the built binary.
set -euo pipefail
cd "$(dirname "$0")/.."

# The same features as the test build, so the two share their compiled crates.
cargo build --locked --workspace --all-features --bin idempotencyd
bin=target/debug/idempotencyd
db="idempotency_smoke_$$"
psql -q "$DATABASE_URL" -c "CREATE DATABASE $db" >/dev/null
trap 'psql -q "$DATABASE_URL" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true' EXIT
url="${DATABASE_URL%/*}/$db"
fail() { echo "smoke-cli: $*" >&2; exit 1; }

DATABASE_URL="$url" "$bin" migrate --log-level warn || fail "migrate failed"
# Migrations outlast the serving statement timeout: a run waiting 2 s for the
# migrations table (as for another pod's run) must not be cut at 100 ms.
psql -q "$url" -c "BEGIN; LOCK TABLE _sqlx_migrations IN ACCESS EXCLUSIVE MODE; SELECT pg_sleep(2); COMMIT;" >/dev/null &
locker=$!
for _ in $(seq 50); do
  held=$(psql -qAt "$url" -c "SELECT count(*) FROM pg_locks WHERE relation = '_sqlx_migrations'::regclass AND mode = 'AccessExclusiveLock' AND granted")
  [ "$held" = 1 ] && break
  sleep 0.1
done
[ "$held" = 1 ] || fail "the test's lock on _sqlx_migrations was never taken"
DATABASE_URL="$url" IDEMPOTENCY_STATEMENT_TIMEOUT=100ms "$bin" migrate --log-level warn ||
  fail "migrate was cut short by the serving statement timeout"
wait "$locker"
psql -q "$url" -c "INSERT INTO idempotency_records (namespace, operation, subject, key, state, fingerprint,
    fencing_token, created_at, expires_at, completed_at, response_status, response_body, response_headers)
  SELECT 'smoke', 'POST /x', '', 'expired-' || n, 'completed', '', 1, now(), now() - interval '1 minute',
         now(), 200, '', '{}' FROM generate_series(1, 25) n" >/dev/null
DATABASE_URL="$url" "$bin" reap --once --log-format json >"/tmp/$db.log" 2>&1 || fail "reap --once exited $?"
grep -q '"deleted":25' "/tmp/$db.log" || fail "reap --once did not report 25 deletions: $(cat "/tmp/$db.log")"
stats=$(DATABASE_URL="$url" "$bin" admin stats --json)
case "$stats" in *'"records":[]'*) ;; *) fail "admin stats after reaping: $stats" ;; esac
if DATABASE_URL="$url" "$bin" admin get --namespace smoke --operation 'POST /x' --key expired-1 2>/dev/null; then
  fail "admin get found a reaped record"
fi
if DATABASE_URL="postgres://nobody@127.0.0.1:1/none" "$bin" reap --once --log-level error 2>/dev/null; then
  fail "reap --once succeeded without a database"
fi
rm -f "/tmp/$db.log"
echo "smoke-cli: migrate, reap --once, admin: ok"
