# Sourced by the bench scripts, inside scripts/with-postgres.sh: the client
# tools of the PostgreSQL whose server binaries that script found (PATH first,
# else Debian's newest /usr/lib/postgresql/*/bin), and `sql`, one statement
# on DATABASE_URL with its single result unadorned.
# shellcheck shell=bash
pg_bin=$(dirname "$(command -v pg_ctl 2>/dev/null || ls -d /usr/lib/postgresql/*/bin/pg_ctl | sort -V | tail -n 1)")
pgbench=$(command -v pgbench 2>/dev/null || echo "$pg_bin/pgbench")
psql=$(command -v psql 2>/dev/null || echo "$pg_bin/psql")
sql() { "$psql" -X -q -A -t -v ON_ERROR_STOP=1 "$DATABASE_URL" -c "$1"; }
