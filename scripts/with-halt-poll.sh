#!/usr/bin/env bash
# Runs a command with the guest's halt polling set, and sets it back after:
#   scripts/with-halt-poll.sh NS COMMAND [ARGS...]
# e.g. scripts/with-halt-poll.sh 200000 make bench
#
# On a KVM guest whose cpuidle driver is haltpoll, an idle vCPU polls for up
# to guest_halt_poll_ns before it halts. With 0 (this workplace's machines)
# it halts at once, and waking it again (a reply arriving for a process that
# sleeps on it) costs the hypervisor's round trip, about 30 µs here against
# about 5 µs for a process woken on a busy vCPU. docs/performance.md,
# "Waking a halted vCPU", measures what that costs each hop of a call; this
# script is how its measurements were made. It changes a machine-wide
# setting (root only) and is for measuring, not for serving: no script of
# this repository calls it. Killed with -9 it cannot set the value back:
# `cat` the parameter after, and write back what it said before (printed first).
set -euo pipefail

say() { printf 'with-halt-poll: %s\n' "$*" >&2; }

if [ $# -lt 2 ] || ! [[ $1 =~ ^[0-9]+$ ]]; then
  say "usage: scripts/with-halt-poll.sh NS COMMAND [ARGS...] (NS: guest_halt_poll_ns, e.g. 200000)"
  exit 2
fi
param=/sys/module/haltpoll/parameters/guest_halt_poll_ns
driver=$(cat /sys/devices/system/cpu/cpuidle/current_driver 2>/dev/null || echo none)
if [ "$driver" != haltpoll ] || [ ! -e "$param" ]; then
  say "this machine's cpuidle driver is '$driver', not haltpoll: nothing to set"
  exit 2
fi
if [ ! -w "$param" ]; then
  say "$param is not writable: run as root"
  exit 2
fi

ns=$1
shift
before=$(cat "$param")
restore() { echo "$before" >"$param" && say "guest_halt_poll_ns back to $before"; }
trap restore EXIT
trap 'exit 130' INT TERM
echo "$ns" >"$param"
say "guest_halt_poll_ns $before -> $(cat "$param") while: $*"
"$@"
