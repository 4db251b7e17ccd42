#!/usr/bin/env bash
# `make test-ha`: the service through a Postgres failover and a planned
# switchover with nothing lost (issue 19), on loopback, in a few minutes.
#
#   etcd ─ Patroni × 3 (PostgreSQL 15, synchronous_mode) ─ HAProxy (/primary)
#     server A ──────────────────────────────► HAProxy
#     server B ─► PgBouncer (session mode) ──► HAProxy
#     verifier (no replay cache) ────────────► HAProxy
#
# tests/src/bin/ha-check.rs loads A and B with many tasks, kills the primary
# (Patroni frozen, `pg_ctl stop -m immediate`, Patroni SIGKILLed: a dead
# host), waits for Patroni to promote the synchronous standby, then makes a
# planned `patronictl switchover`, and checks and prints the figures:
# nothing acknowledged lost, no key answered twice differently, no logic run
# twice under a live lease, only retryable codes, recovery times. A last
# step runs a server through PgBouncer in transaction mode and checks what
# that does (docs/operations.md, "Failover, tested").
#
# Needs patroni, etcd-server, etcd-client, haproxy and pgbouncer (Debian 12's
# packages) and PostgreSQL's server binaries: installed with apt-get when
# missing and run as root, with services kept from starting; otherwise the
# command to install them is printed. Everything runs as an unprivileged
# user (`postgres` when started as root) in a temporary folder, removed at
# the end; every process is stopped however the test ends.
#
# HA_STEADY (default 5s): each steady phase; HA_TASKS (32): load tasks;
# HA_KEEP=1 keeps the folder (logs) after a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
# haproxy and pgbouncer install into /usr/sbin, which a user's PATH may lack.
PATH=$PATH:/usr/sbin:/sbin

say() { printf 'test-ha: %s\n' "$*" >&2; }

# --- as root: install, build, then go on as an unprivileged user -------------
packages_needed() {
  local needed=()
  command -v patroni >/dev/null 2>&1 || needed+=(patroni)
  /usr/bin/python3 -c "import etcd" >/dev/null 2>&1 || needed+=(python3-etcd)
  command -v etcd >/dev/null 2>&1 || needed+=(etcd-server)
  command -v etcdctl >/dev/null 2>&1 || needed+=(etcd-client)
  command -v haproxy >/dev/null 2>&1 || needed+=(haproxy)
  command -v pgbouncer >/dev/null 2>&1 || needed+=(pgbouncer)
  pg_bin >/dev/null || needed+=(postgresql-15)
  echo "${needed[@]}"
}

pg_bin() {
  local candidate
  for candidate in /usr/lib/postgresql/15/bin $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -rV); do
    [ -x "$candidate/initdb" ] && [ -x "$candidate/pg_ctl" ] && { echo "$candidate"; return 0; }
  done
  return 1
}

# Installs with a policy-rc.d that forbids starting services (a package's
# default service, e.g. etcd on port 2379 or haproxy, would otherwise start
# system-wide and stay), then disables them for later boots.
install_packages() {
  local policy=/usr/sbin/policy-rc.d saved=
  if [ -e "$policy" ]; then
    saved=$(mktemp)
    cp -p "$policy" "$saved"
  fi
  printf '#!/bin/sh\n# test-ha: no service starts while packages install\nexit 101\n' >"$policy"
  chmod 755 "$policy"
  local status=0
  apt-get update -qq >&2 || status=$?
  local log
  log=$(mktemp)
  if [ "$status" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >"$log" 2>&1 || status=$?
  fi
  if [ -n "$saved" ]; then mv "$saved" "$policy"; else rm -f "$policy"; fi
  [ "$status" = 0 ] || { cat "$log" >&2; rm -f "$log"; say "apt-get install $* failed"; exit 1; }
  grep -E 'policy-rc.d denied|^Setting up' "$log" | sed 's/^/test-ha: apt: /' >&2 || true
  rm -f "$log"
  if [ -d /run/systemd/system ]; then
    systemctl disable --now etcd haproxy pgbouncer >/dev/null 2>&1 || true
  fi
}

if [ "${HA_STAGE:-}" != run ]; then
  read -r -a needed <<<"$(packages_needed)"
  if [ "${#needed[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      say "installing ${needed[*]} (Debian packages; their services are kept from starting)"
      install_packages "${needed[@]}"
    else
      say "missing: ${needed[*]}"
      say "install them with:  sudo apt-get install -y --no-install-recommends ${needed[*]}"
      say "(then: sudo systemctl disable --now etcd haproxy pgbouncer, if they started)"
      exit 1
    fi
  fi
  # The features of make test's build, so that the two share their crates.
  cargo build --locked -q --workspace --all-features --bin idempotencyd --bin ha-check
  if [ "$(id -u)" = 0 ]; then
    id postgres >/dev/null 2>&1 ||
      useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin postgres
    exec runuser -u postgres -- env HA_STAGE=run PATH="$PATH" HA_STEADY="${HA_STEADY:-}" \
      HA_TASKS="${HA_TASKS:-}" HA_KEEP="${HA_KEEP:-}" HA_SSLMODE="${HA_SSLMODE:-}" \
      HA_SYNC_STRICT="${HA_SYNC_STRICT:-}" CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-}" \
      bash "$repo/scripts/test-ha.sh"
  fi
fi

# --- as an unprivileged user ---------------------------------------------------
target=${CARGO_TARGET_DIR:-$repo/target}
server_bin=$target/debug/idempotencyd
check_bin=$target/debug/ha-check
pg_bin=$(pg_bin)
steady=${HA_STEADY:-5s}
tasks=${HA_TASKS:-32}

dir=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-ha.XXXXXX")
export HOME=$dir
pids=()
cleanup() {
  local status=$? index pid node
  trap - EXIT INT TERM
  # Last started, first stopped: the servers before the database, etcd last.
  for ((index = ${#pids[@]} - 1; index >= 0; index--)); do
    pid=${pids[$index]}
    kill -TERM -- "-$pid" 2>/dev/null || continue
    for _ in $(seq 100); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
  for node in 1 2 3; do
    if [ -f "$dir/node$node/postmaster.pid" ]; then
      "$pg_bin/pg_ctl" -D "$dir/node$node" -m immediate stop >/dev/null 2>&1 || true
    fi
  done
  if [ "$status" != 0 ]; then
    say "FAILED (status $status); the last lines of each log:"
    local log
    for log in "$dir"/*.log; do
      [ -f "$log" ] || continue
      printf '\n--- %s (first errors, last lines)\n' "$log" >&2
      grep -m 5 -E '"level":"ERROR"|panicked|^Error|FATAL|CRITICAL' "$log" | cut -c1-600 >&2 || true
      printf '...\n' >&2
      tail -n 15 "$log" | cut -c1-600 >&2
    done
    if [ -n "${HA_KEEP:-}" ]; then say "kept $dir"; exit "$status"; fi
  fi
  rm -rf "$dir"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Starts "$@" in a process group of its own (so that stopping it stops its
# children), output to $dir/$name.log; its pid is the group's id.
start() {
  local name=$1
  shift
  setsid "$@" >"$dir/$name.log" 2>&1 </dev/null &
  pids+=("$!")
  echo "$!" >"$dir/$name.pid"
  # Not a job of this shell: no "Killed" notice when the test stops it.
  disown "$!"
}

# Sets variable $1 to a free port below Linux's ephemeral range (32768 and
# up), so that no outgoing connection takes it before its process binds it.
used_ports=" "
port_is_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
free_port() {
  local port
  while :; do
    port=$((20000 + RANDOM % 12000))
    case $used_ports in *" $port "*) continue ;; esac
    port_is_free "$port" || continue
    used_ports+="$port "
    printf -v "$1" %s "$port"
    return
  done
}

# Polls `$@` every 0.1 s until it succeeds, for at most $1 seconds.
wait_for() {
  local seconds=$1 what=$2
  shift 2
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      say "$what: not within ${seconds}s"
      return 1
    fi
    sleep 0.1
  done
}

etcd_port='' etcd_peer='' haproxy_port='' bouncer_session='' bouncer_transaction=''
free_port etcd_port
free_port etcd_peer
free_port haproxy_port
free_port bouncer_session
free_port bouncer_transaction
declare -A pg_port rest_port
for node in 1 2 3; do
  free_port "pg_port[$node]"
  free_port "rest_port[$node]"
  echo "node$node ${rest_port[$node]}" >>"$dir/rest-ports"
done

# --- etcd ----------------------------------------------------------------------
start etcd etcd --name ha --data-dir "$dir/etcd" \
  --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
  --listen-peer-urls "http://127.0.0.1:$etcd_peer" --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer" \
  --initial-cluster "ha=http://127.0.0.1:$etcd_peer" --initial-cluster-state new
wait_for 30 "etcd answering" etcdctl --endpoints "127.0.0.1:$etcd_port" endpoint health

# --- Patroni × 3 ---------------------------------------------------------------
# ttl 6 s, loop_wait 1 s, retry_timeout 2 s (loop_wait + 2 × retry_timeout ≤
# ttl, as Patroni's docs ask): the leader key of a dead primary expires
# within 6 s. synchronous_mode: a Complete is acknowledged only once a
# standby has its commit, and only that standby may be promoted.
# synchronous_mode_strict off (HA_SYNC_STRICT=true turns it on): see
# docs/operations.md, "Failover, tested". fsync stays on: durability is
# what is tested.
for node in 1 2 3; do
  cat >"$dir/node$node.yml" <<EOF
scope: ha
name: node$node
restapi:
  listen: 127.0.0.1:${rest_port[$node]}
  connect_address: 127.0.0.1:${rest_port[$node]}
etcd3:
  hosts: 127.0.0.1:$etcd_port
bootstrap:
  dcs:
    ttl: 6
    loop_wait: 1
    retry_timeout: 2
    maximum_lag_on_failover: 1048576
    synchronous_mode: true
    synchronous_mode_strict: ${HA_SYNC_STRICT:-false}
    postgresql:
      use_pg_rewind: true
      parameters:
        max_connections: 200
        wal_log_hints: "on"
        max_wal_senders: 10
        max_replication_slots: 10
        wal_keep_size: 128MB
  initdb:
    - encoding: UTF8
    - no-locale
    - auth: trust
  pg_hba:
    - local all all trust
    - host all all 127.0.0.1/32 trust
    - host replication all 127.0.0.1/32 trust
postgresql:
  listen: 127.0.0.1:${pg_port[$node]}
  connect_address: 127.0.0.1:${pg_port[$node]}
  data_dir: $dir/node$node
  bin_dir: $pg_bin
  pgpass: $dir/pgpass$node
  authentication:
    superuser:
      username: postgres
    replication:
      username: postgres
  parameters:
    unix_socket_directories: $dir
    listen_addresses: 127.0.0.1
EOF
  start "node$node" patroni "$dir/node$node.yml"
done

# The cluster as patronictl sees it: "name role state" per member.
members() {
  patronictl -c "$dir/node1.yml" list -f json 2>/dev/null | /usr/bin/python3 -c '
import json, sys
for m in json.load(sys.stdin):
    print(m["Member"], m["Role"].replace(" ", "_"), m["State"])'
}
cluster_ready() {
  local state
  state=$(members)
  grep -q ' Leader running$' <<<"$state" &&
    [ "$(grep -c ' Sync_Standby \(running\|streaming\)$' <<<"$state")" = 1 ] &&
    [ "$(grep -c ' \(Sync_Standby\|Replica\) \(running\|streaming\)$' <<<"$state")" = 2 ]
}
wait_for 120 "a leader, a synchronous standby and a replica" cluster_ready
members | sed "s/^/test-ha: patroni ($SECONDS s): /" >&2

# --- HAProxy: the primary, by Patroni's /primary check ------------------------
{
  cat <<EOF
global
  maxconn 1000
defaults
  mode tcp
  timeout connect 1s
  timeout client 30m
  timeout server 30m
  timeout check 1s
listen primary
  bind 127.0.0.1:$haproxy_port
  option httpchk OPTIONS /primary
  http-check expect status 200
  default-server inter 500ms fastinter 250ms fall 2 rise 1 on-marked-down shutdown-sessions
EOF
  for node in 1 2 3; do
    echo "  server node$node 127.0.0.1:${pg_port[$node]} maxconn 200 check port ${rest_port[$node]}"
  done
} >"$dir/haproxy.cfg"
start haproxy haproxy -f "$dir/haproxy.cfg" -db
# The URLs keep the default sslmode (prefer), as a user's would: while HAProxy
# has no primary it accepts connections and closes them during the TLS
# negotiation, which the server must answer UNAVAILABLE (retryable), not
# INTERNAL. HA_SSLMODE sets another.
ssl_param=${HA_SSLMODE:+?sslmode=$HA_SSLMODE}
primary_url="postgres://postgres@127.0.0.1:$haproxy_port/postgres$ssl_param"
wait_for 30 "HAProxy reaching the primary" "$pg_bin/pg_isready" -q -d "$primary_url"

# --- PgBouncer, in session and transaction mode -------------------------------
# ignore_startup_parameters: the server sets statement_timeout and the
# planner options as the startup parameter `options`, which PgBouncer 1.18
# refuses otherwise (and, so accepted, drops; see docs/operations.md).
# server_login_retry 1 s (default 15 s): a login refused while HAProxy has
# no primary is retried soon.
echo '"postgres" ""' >"$dir/userlist.txt"
for mode in session transaction; do
  port=$bouncer_session
  [ "$mode" = transaction ] && port=$bouncer_transaction
  cat >"$dir/pgbouncer-$mode.ini" <<EOF
[databases]
* = host=127.0.0.1 port=$haproxy_port
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
auth_type = trust
auth_file = $dir/userlist.txt
pool_mode = $mode
max_client_conn = 400
default_pool_size = 40
server_login_retry = 1
ignore_startup_parameters = ${HA_BOUNCER_IGNORE-extra_float_digits,options}
EOF
done
start pgbouncer-session pgbouncer "$dir/pgbouncer-session.ini"
wait_for 30 "PgBouncer (session) reaching the primary" \
  "$pg_bin/pg_isready" -q -d "postgres://postgres@127.0.0.1:$bouncer_session/postgres"

# --- the servers ----------------------------------------------------------------
# Interval 1 s: NOT_SERVING within 2 s of the database not answering.
declare -A grpc_addr health_addr
# Starts server $1 on database URL $2 (more flags after), and waits until
# its health port accepts connections. A port taken by another process
# between free_port and the bind makes the server exit at once: then again
# on other ports.
server() {
  local name=$1 url=$2
  shift 2
  local grpc health metrics attempt pid deadline
  for attempt in 1 2 3; do
    free_port grpc
    free_port health
    free_port metrics
    grpc_addr[$name]=127.0.0.1:$grpc
    health_addr[$name]=127.0.0.1:$health
    start "$name" "$server_bin" serve --database-url "$url" --grpc-addr "${grpc_addr[$name]}" \
      --health-addr "${health_addr[$name]}" --metrics-addr "127.0.0.1:$metrics" \
      --health-check-interval 1s --log-format json --log-level warn "$@"
    pid=$(cat "$dir/$name.pid")
    deadline=$((SECONDS + 60))
    while kill -0 "$pid" 2>/dev/null && port_is_free "$health" && [ "$SECONDS" -lt "$deadline" ]; do
      sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null && ! port_is_free "$health"; then return 0; fi
    if grep -qi 'address already in use' "$dir/$name.log"; then
      say "server $name: a port was taken (attempt $attempt); again on others"
      continue
    fi
    say "server $name did not start listening"
    return 1
  done
  return 1
}
server a "$primary_url" --migrate
"$check_bin" wait-serving --health "${health_addr[a]}" --within 60s
server b "postgres://postgres@127.0.0.1:$bouncer_session/postgres$ssl_param"
server verifier "$primary_url" --replay-cache-bytes 0
"$check_bin" wait-serving --health "${health_addr[b]},${health_addr[verifier]}" --within 60s

# Whether Patroni's REST API on port $1 answers 200 to GET /primary.
is_primary() {
  local status=
  exec 3<>"/dev/tcp/127.0.0.1/$1" || return 1
  printf 'GET /primary HTTP/1.0\r\n\r\n' >&3
  read -r _ status _ <&3 || true
  exec 3<&-
  [ "$status" = 200 ]
}

# --- the events -----------------------------------------------------------------
# The primary's host dies: Patroni frozen (so that it cannot restart
# Postgres), Postgres stopped at once without a checkpoint, Patroni killed.
cat >"$dir/kill-primary.sh" <<EOF
#!/usr/bin/env bash
set -euo pipefail
$(declare -f is_primary)
leader=
for node in 1 2 3; do
  port=\$(sed -n "s/^node\$node //p" "$dir/rest-ports")
  if is_primary "\$port" 2>/dev/null; then leader=node\$node; fi
done
[ -n "\$leader" ] || { echo "test-ha: no primary to kill" >&2; exit 1; }
group=\$(cat "$dir/\$leader.pid")
echo "test-ha: killing \$leader (Patroni's process group \$group)" >&2
kill -STOP -- "-\$group"
"$pg_bin/pg_ctl" -D "$dir/\$leader" -m immediate stop >/dev/null
kill -KILL -- "-\$group"
EOF
# Before each event: a leader and a synchronous standby (after a failover,
# the surviving replica becomes the new primary's synchronous standby only
# once it follows it; Patroni refuses a switchover until then).
cat >"$dir/wait-sync.sh" <<EOF
#!/usr/bin/env bash
set -euo pipefail
dir=$dir
$(declare -f members)
deadline=\$((SECONDS + 60))
until state=\$(members) && grep -q ' Leader running\$' <<<"\$state" &&
  grep -q ' Sync_Standby \(running\|streaming\)\$' <<<"\$state"; do
  [ "\$SECONDS" -lt "\$deadline" ] || { echo "test-ha: no synchronous standby within 60 s" >&2; exit 1; }
  sleep 0.2
done
EOF
cat >"$dir/switchover.sh" <<EOF
#!/usr/bin/env bash
set -euo pipefail
patronictl -c "$dir/node1.yml" switchover --force >&2
EOF
chmod +x "$dir/kill-primary.sh" "$dir/switchover.sh" "$dir/wait-sync.sh"

"$check_bin" run --endpoints "${grpc_addr[a]},${grpc_addr[b]}" \
  --health "${health_addr[a]},${health_addr[b]}" --verify "${grpc_addr[verifier]}" --tasks "$tasks" --steady "$steady" \
  --before-each "$dir/wait-sync.sh" \
  --event "failover=$dir/kill-primary.sh" --event "switchover=$dir/switchover.sh"
members | sed 's/^/test-ha: patroni after: /' >&2

# --- PgBouncer: what it does to the server's connections ----------------------
# Session mode (server B above) carries the load through the failover. Here:
# what PgBouncer 1.18 does to the startup options in either mode, and why
# transaction mode does not work; each is checked, so that the reason given
# in docs/operations.md stays true.
psql() { "$pg_bin/psql" -X -A -t -q -v ON_ERROR_STOP=1 "$@"; }
bouncer_url() { echo "postgres://postgres@127.0.0.1:$1/postgres?sslmode=disable"; }
start pgbouncer-transaction pgbouncer "$dir/pgbouncer-transaction.ini"
wait_for 30 "PgBouncer (transaction) reaching the primary" \
  "$pg_bin/pg_isready" -q -d "$(bouncer_url "$bouncer_transaction")"

# 1. The options the server sets at login (statement_timeout, the planner's)
#    are dropped by ignore_startup_parameters, in both modes.
timeouts=
for url in "$primary_url" "$(bouncer_url "$bouncer_session")" "$(bouncer_url "$bouncer_transaction")"; do
  timeouts+=" $(PGOPTIONS='-c statement_timeout=4321' psql -d "$url" -c 'SHOW statement_timeout')"
done
say "statement_timeout=4321 sent as a startup option; in force directly, through session, through transaction mode:$timeouts"
[ "$timeouts" = " 4321ms 0 0" ] || { say "CHECK FAILED: expected 4321ms directly and 0 (dropped) through PgBouncer"; exit 1; }

# 2. A session advisory lock (the reaper's, which makes one replica the
#    reaper) outlives its client session in transaction mode: it stays on
#    the server connection PgBouncer keeps.
psql -d "$(bouncer_url "$bouncer_transaction")" -c 'SELECT pg_try_advisory_lock(4242)' >/dev/null
leaked=$(psql -d "$primary_url" -c "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = 4242")
say "session advisory locks still held after the client's session through transaction mode ended: $leaked"
[ "$leaked" = 1 ] || { say "CHECK FAILED: expected the advisory lock to outlive the session in transaction mode"; exit 1; }

# The database errors in a server's JSON log, counted, statement names elided.
database_errors() {
  /usr/bin/python3 - "$1" <<'EOF'
import collections, json, re, sys
seen = collections.Counter()
def note(message):
    seen[re.sub(r'\\?"[^"\\]*\\?"', '"…"', message)] += 1
for line in open(sys.argv[1]):
    try:
        error = json.loads(line).get("error", "")
    except ValueError:
        continue
    for code, message in re.findall(r'code: "(\w+)", message: "((?:[^"\\]|\\.)*)"', error):
        note(f"{code} {message}")
    for message in re.findall(r"error returned from database: (.*)", error):
        note(message)
for message, count in seen.most_common():
    print(f"  {count:6} {message}")
EOF
}

# 3. The server through transaction mode: its named prepared statements
#    (sqlx's per-connection cache) meet other clients' server connections.
#    Without the cache (statement-cache-capacity=0 in the URL) sqlx still
#    prepares, unnamed, and the Bind can reach another server connection.
for variant in cached uncached; do
  url=$(bouncer_url "$bouncer_transaction")
  [ "$variant" = uncached ] && url+="&statement-cache-capacity=0"
  server "$variant" "$url"
  "$check_bin" wait-serving --health "${health_addr[$variant]}" --within 30s
  if "$check_bin" run --endpoints "${grpc_addr[$variant]}" --health "${health_addr[$variant]}" \
    --verify "${grpc_addr[verifier]}" --tasks 8 --steady 3s >"$dir/$variant-check.out"; then
    cat "$dir/$variant-check.out" >&2
    say "CHECK FAILED: the server through PgBouncer in transaction mode ($variant statements) passed; update docs/operations.md"
    exit 1
  fi
  grep -E '^  (steady|CHECK)|^replayed' "$dir/$variant-check.out" | sed "s/^/test-ha: transaction mode, $variant statements: /" >&2
  errors=$(database_errors "$dir/$variant.log")
  printf 'test-ha: transaction mode, %s statements, database errors:\n%s\n' "$variant" "$errors" >&2
  [ -n "$errors" ] || { say "CHECK FAILED: expected prepared-statement errors through transaction mode"; exit 1; }
done
say "PASS in $SECONDS s"
