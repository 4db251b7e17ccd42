#!/usr/bin/env bash
# The Python client's tests (clients/python/tests, pytest) against the real
# server: a virtualenv in target/python-venv (created when missing), the
# package installed from this checkout (its gRPC stubs generated from proto/
# as it builds), then pytest. Each test module starts target/debug/idempotencyd
# on a database of its own, made through DATABASE_URL (scripts/with-postgres.sh
# provides one). Also checks the shared fingerprint vectors
# (tests/vectors/fingerprints.json).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${DATABASE_URL:-}" ]; then
  echo "test-python: DATABASE_URL is not set; run: scripts/with-postgres.sh $0" >&2
  exit 1
fi
# The same build as scripts/smoke-cli.sh, so that after it this is a no-op.
cargo build --locked --workspace --all-features --bin idempotencyd

venv=target/python-venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check ./clients/python \
  pytest opentelemetry-api opentelemetry-sdk
"$venv/bin/python" -m pytest -q -p no:cacheprovider clients/python/tests "$@"
