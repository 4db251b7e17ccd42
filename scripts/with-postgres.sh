#!/usr/bin/env bash
# Runs a command with DATABASE_URL set.
#
# When DATABASE_URL is already set, the command runs against that database.
# Otherwise a throwaway PostgreSQL cluster is started in a temporary folder on a
# free loopback port (as the `postgres` user when run as root, since initdb
# refuses root), and stopped and deleted when the command ends.
#
# PG_FSYNC=off trades durability for speed (the test suite uses it: the
# cluster is thrown away anyway); the default is Postgres's own, on.
# PG_OPTIONS adds server settings, e.g. "-c shared_buffers=2GB" (make bench-scale).
set -euo pipefail

if [ -n "${DATABASE_URL:-}" ]; then
  exec "$@"
fi

say() { printf 'with-postgres: %s\n' "$*" >&2; }

find_pg_bin() {
  if command -v initdb >/dev/null 2>&1 && command -v pg_ctl >/dev/null 2>&1; then
    dirname "$(command -v pg_ctl)"
    return 0
  fi
  local candidate
  candidate=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
  if [ -n "$candidate" ] && [ -x "$candidate/initdb" ]; then
    echo "$candidate"
    return 0
  fi
  return 1
}

if ! pg_bin=$(find_pg_bin); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "PostgreSQL server binaries not found; installing the Debian package postgresql"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    pg_bin=$(find_pg_bin) || { say "postgresql installed but initdb not found"; exit 1; }
  else
    say "PostgreSQL server binaries (initdb, pg_ctl) not found."
    say "Install them with:  sudo apt-get install -y postgresql"
    say "or set DATABASE_URL to a database whose role may CREATE DATABASE."
    exit 1
  fi
fi

dir=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-pg.XXXXXX")
chmod 755 "$dir"
run_pg() { "$pg_bin/$1" "${@:2}"; }
if [ "$(id -u)" = 0 ]; then
  id postgres >/dev/null 2>&1 || useradd --system --home-dir "$dir" --shell /usr/sbin/nologin postgres
  chown postgres: "$dir"
  run_pg() { runuser -u postgres -- "$pg_bin/$1" "${@:2}"; }
fi

cleanup() {
  run_pg pg_ctl -D "$dir/data" -m fast -w stop >/dev/null 2>&1 || true
  rm -rf "$dir"
}
trap cleanup EXIT

run_pg initdb -D "$dir/data" -U postgres --auth=trust -E UTF8 --no-locale >"$dir/initdb.log" 2>&1 ||
  { cat "$dir/initdb.log" >&2; exit 1; }

port_is_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

started=
for attempt in 1 2 3 4 5; do
  port=$((20000 + RANDOM % 30000))
  port_is_free "$port" || continue
  if run_pg pg_ctl -D "$dir/data" -l "$dir/data/server.log" -w -t 60 \
    -o "-p $port -k $dir -c listen_addresses=127.0.0.1 -c fsync=${PG_FSYNC:-on} -c max_connections=${PG_MAX_CONNECTIONS:-300} ${PG_OPTIONS:-}" \
    start >/dev/null; then
    started=1
    break
  fi
done
if [ -z "$started" ]; then
  say "could not start PostgreSQL; its log:"
  cat "$dir/data/server.log" >&2 || true
  exit 1
fi

export DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres"
say "throwaway PostgreSQL at $DATABASE_URL (data in $dir, removed on exit)"
"$@"
