#!/usr/bin/env bash
# Every check CI runs: proto lint, deployment checks (Helm chart, Kubernetes
# schemas, alert rules), formatting, lints, the binary's commands, all
# tests against a real Postgres (DATABASE_URL, from scripts/with-postgres.sh),
# the Python client's tests against the built server, and the failover test.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/check-proto.sh
# Also installs the tools the tests use (promtool).
scripts/check-deploy.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings
scripts/smoke-cli.sh
# nextest, not cargo test: it runs each test in a process of its own, and
# the metric tests need that (a process has one metrics recorder, which
# tests sharing a process would all count into).
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "test: installing cargo-nextest (cargo install cargo-nextest --locked)" >&2
  cargo install cargo-nextest --locked
fi
# nextest does not run doctests: the crate docs' quickstart must compile too.
cargo test --doc --workspace --all-features --locked
cargo nextest run --workspace --all-features --locked --no-fail-fast
# The Python client (clients/python) against the real server, and the
# fingerprint vectors it shares with the Rust client.
scripts/test-python.sh
# Postgres failover and switchover under load, nothing lost (its own
# cluster: Patroni, etcd, HAProxy, PgBouncer; DATABASE_URL is not used).
scripts/test-ha.sh
# The README's sessions, pasted into a shell against a fresh server.
scripts/check-readme.sh
