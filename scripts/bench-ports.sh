# Sourced by the bench scripts that start servers of their own beside a
# throwaway Postgres (bench-floor.sh, bench-stream.sh, bench-client-stream.sh). They define `say` and
# `work` (the directory of their servers' *.log) before calling wait_port.

free_ports() { # N free ports outside the kernel's ephemeral range, so that no outgoing
  # connection (a driver's to Postgres) is given one between this choice and the bind.
  python3 -c 'import random, socket, sys
low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
spans = [(r, s) for r, s in ((10000, low), (high + 1, 65536)) if s - r >= 1000]
if not spans:
    sys.exit(f"no room for ports outside the ephemeral range {low}-{high}")
ports, tries = [], 0
while len(ports) < int(sys.argv[1]) and tries < 10000:
    tries += 1
    port = random.randrange(*random.choice(spans))
    if port in ports:
        continue
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        ports.append(port)
    except OSError:
        pass
    finally:
        s.close()
if len(ports) < int(sys.argv[1]):
    sys.exit("no free ports found")
print(" ".join(map(str, ports)))' "$1"
}
wait_port() {
  for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return; sleep 0.1; done
  say "nothing listens on port $1; logs:"; cat "$work"/*.log >&2; exit 1
}
