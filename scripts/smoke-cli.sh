#!/usr/bin/env bash
# The binary's own commands against DATABASE_URL: migrate, reap --once,
# admin, the URL from a file, and passwords kept out of their output. The
# Rust tests cover the logic behind them; this checks the wiring (flags,
# environment, exit codes, output) of the built binary.
set -euo pipefail
cd "$(dirname "$0")/.."

# The same features as the test build, so the two share their compiled crates.
cargo build --locked --workspace --all-features --bin idempotencyd
bin=target/debug/idempotencyd
db="idempotency_smoke_$$"
psql -q "$DATABASE_URL" -c "CREATE DATABASE $db" >/dev/null
tmp=$(mktemp -d)
trap 'psql -q "$DATABASE_URL" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
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

# The URL from a file (a mounted secret), by flag or environment, for every
# command; exactly one of DATABASE_URL and the file.
printf '%s\n' "$url" >"$tmp/url"
env -u DATABASE_URL "$bin" migrate --log-level warn --database-url-file "$tmp/url" ||
  fail "migrate --database-url-file failed"
stats=$(env -u DATABASE_URL DATABASE_URL_FILE="$tmp/url" "$bin" admin stats --json) ||
  fail "admin stats with DATABASE_URL_FILE failed"
case "$stats" in *'"records":[]'*) ;; *) fail "admin stats from the URL file: $stats" ;; esac
stats=$(env -u DATABASE_URL "$bin" admin --database-url-file "$tmp/url" stats --json) ||
  fail "admin --database-url-file stats failed"
if DATABASE_URL="$url" "$bin" migrate --database-url-file "$tmp/url" 2>"$tmp/err"; then
  fail "migrate took both DATABASE_URL and --database-url-file"
fi
grep -q -- '--database-url-file' "$tmp/err" || fail "no clear error for both URL sources: $(cat "$tmp/err")"
if env -u DATABASE_URL "$bin" migrate 2>"$tmp/err"; then fail "migrate ran without a database URL"; fi
grep -q -- '--database-url-file' "$tmp/err" || fail "no clear error without a URL: $(cat "$tmp/err")"
printf ' \n' >"$tmp/empty"
if env -u DATABASE_URL "$bin" migrate --database-url-file "$tmp/empty" 2>"$tmp/err"; then
  fail "migrate ran with an empty URL file"
fi
grep -q "$tmp/empty" "$tmp/err" || fail "the empty-file error does not name the file: $(cat "$tmp/err")"

# A password never reaches the output, whatever it holds: the issue's two
# (unencoded '/', '?', '#', '@': refused, as sqlx would read another host),
# one percent-encoded and one as a query parameter (both refused by the
# database at 127.0.0.1:1), from the environment and from the file.
secrets='SecretTail|Qx7|w0rd|ss/w|#x\?y|p@ss'
export IDEMPOTENCY_DB_ACQUIRE_TIMEOUT=300ms
for secret_url in 'postgres://idem:Qx7/SecretTailA@127.0.0.1:1/x' \
  'postgres://idem:p@ss/w0rd#x?y=z@127.0.0.1:1/x' \
  'postgres://idem:p%40ss%2Fw0rd%23x%3Fy%3Dz@127.0.0.1:1/x' \
  'postgres://idem@127.0.0.1:1/x?sslmode=disable&password=Qx7/SecretTailA'; do
  printf '%s\n' "$secret_url" >"$tmp/secret-url"
  : >"$tmp/all"
  DATABASE_URL="$secret_url" timeout 2 "$bin" serve --grpc-addr 127.0.0.1:0 --metrics-addr 127.0.0.1:0 \
    >>"$tmp/all" 2>&1 || true
  DATABASE_URL="$secret_url" "$bin" migrate >>"$tmp/all" 2>&1 && fail "migrate reached 127.0.0.1:1"
  env -u DATABASE_URL DATABASE_URL_FILE="$tmp/secret-url" timeout 2 "$bin" serve \
    --grpc-addr 127.0.0.1:0 --metrics-addr 127.0.0.1:0 --log-format json >>"$tmp/all" 2>&1 || true
  env -u DATABASE_URL "$bin" admin --database-url-file "$tmp/secret-url" stats >>"$tmp/all" 2>&1 &&
    fail "admin stats reached 127.0.0.1:1"
  DATABASE_URL="$secret_url" "$bin" migrate --database-url-file "$tmp/url" >>"$tmp/all" 2>&1 &&
    fail "migrate took both URL sources"
  DATABASE_URL="$secret_url" "$bin" serve --help >>"$tmp/all" 2>&1
  if grep -E "$secrets" "$tmp/all" >&2; then fail "a part of the password of $secret_url was printed"; fi
  case "$secret_url" in
    *%2F*) shown='postgres://idem:***@127.0.0.1:1/x' ;;
    *password=*) shown='postgres://idem@127.0.0.1:1/x?sslmode=disable&password=***' ;;
    *) shown='percent-encode' ;;
  esac
  grep -qF "$shown" "$tmp/all" || fail "no $shown in the output for $secret_url: $(cat "$tmp/all")"
done
unset IDEMPOTENCY_DB_ACQUIRE_TIMEOUT

# admin purge of many records: refused without --yes when no terminal can
# ask (nothing deleted, exit status 1), done with it; each leaves an audit
# line on stderr (whatever the log level), and stdout holds the answer
# alone. The URL carries a password (trust authentication ignores it), which
# no line shows.
psql -q "$url" -c "INSERT INTO idempotency_records (namespace, operation, subject, key, state, fingerprint,
    fencing_token, created_at, expires_at, completed_at, response_status, response_body, response_headers)
  SELECT 'smoke', 'POST /x', 'user-' || (n % 3), 'live-' || n, 'completed', '', 1, now(),
         now() + interval '1 hour', now(), 200, '', '{}' FROM generate_series(1, 30) n" >/dev/null
secret_db_url="${url/postgres@/postgres:SecretTailB@}"
psql -q "$secret_db_url" -c 'SELECT 1' >/dev/null 2>&1 || secret_db_url="$url"
count_smoke() { psql -qAt "$url" -c "SELECT count(*) FROM idempotency_records WHERE namespace = 'smoke'"; }
set +e
DATABASE_URL="$secret_db_url" "$bin" admin --log-format json --log-level error purge --namespace smoke \
  </dev/null >"$tmp/out" 2>"$tmp/err"
status=$?
set -e
cat "$tmp/out" "$tmp/err" >"$tmp/purge-all"
[ "$status" = 1 ] || fail "admin purge without --yes and without a terminal exited $status"
[ "$(count_smoke)" = 30 ] || fail "admin purge without --yes deleted records"
grep -q 'not purging 30 records' "$tmp/err" || fail "no clear refusal: $(cat "$tmp/err")"
grep '"target":"audit"' "$tmp/err" | grep -q '"outcome":"refused"' ||
  fail "no audit line for the refused purge: $(cat "$tmp/err")"
DATABASE_URL="$secret_db_url" IDEMPOTENCY_ADMIN_OPERATOR=smoke-operator "$bin" admin purge \
  --namespace smoke --subject user-1 --yes --json --log-format json >"$tmp/out" 2>"$tmp/err" ||
  fail "admin purge --yes failed: $(cat "$tmp/err")"
cat "$tmp/out" "$tmp/err" >>"$tmp/purge-all"
grep -q '"deleted":10' "$tmp/out" || fail "admin purge --yes answered: $(cat "$tmp/out")"
[ "$(wc -l <"$tmp/out")" = 1 ] || fail "admin purge printed more than its answer on stdout: $(cat "$tmp/out")"
audit=$(grep '"target":"audit"' "$tmp/err") || fail "no audit line on stderr: $(cat "$tmp/err")"
for field in '"event":"admin_purge"' '"outcome":"purged"' '"operator":"smoke-operator"' \
  '"namespace":"smoke"' '"subject":"user-1"' '"deleted":10' "\"database\":\"127.0.0.1:[0-9]*/$db\""; do
  grep -q "$field" <<<"$audit" || fail "the audit line lacks $field: $audit"
done
[ "$(count_smoke)" = 20 ] || fail "admin purge --subject user-1 left $(count_smoke) of 30 (want 20)"
DATABASE_URL="$secret_db_url" "$bin" admin purge --namespace smoke --yes >"$tmp/out" 2>"$tmp/err" ||
  fail "admin purge --yes (text) failed: $(cat "$tmp/err")"
grep -q 'audit' "$tmp/err" || fail "no audit line in text logs: $(cat "$tmp/err")"
[ "$(count_smoke)" = 0 ] || fail "admin purge --namespace smoke --yes left records"
cat "$tmp/out" "$tmp/err" >>"$tmp/purge-all"
if grep -q SecretTailB "$tmp/purge-all"; then fail "admin purge printed the password"; fi

# libpq's TLS variables fill in what the URL does not say (the chart's
# CloudNativePG example relies on it: the operator's Secret holds a URL
# without sslmode); a URL that says it wins. This Postgres has no TLS.
if DATABASE_URL="$url" PGSSLMODE=verify-full "$bin" migrate --log-level warn >"$tmp/out" 2>&1; then
  fail "PGSSLMODE=verify-full was ignored: migrate connected without TLS"
fi
grep -q 'server does not support TLS' "$tmp/out" || fail "PGSSLMODE=verify-full: $(cat "$tmp/out")"
PGSSLMODE=verify-full DATABASE_URL="$url?sslmode=disable" "$bin" migrate --log-level warn ||
  fail "the URL's sslmode=disable did not win over PGSSLMODE"

echo "smoke-cli: migrate, reap --once, admin, purge, URL file, redaction, libpq TLS variables: ok"
