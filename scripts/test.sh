#!/usr/bin/env bash
# Every check CI runs: proto lint, deployment checks (Helm chart, Kubernetes
# schemas, alert rules), formatting, lints, the binary's commands, and all
# tests against a real Postgres (DATABASE_URL, from scripts/with-postgres.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/lint-proto.sh
# Also installs the tools the tests use (promtool).
scripts/check-deploy.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings
scripts/smoke-cli.sh
if cargo nextest --version >/dev/null 2>&1; then
  # nextest does not run doctests: the crate docs' quickstart must compile too.
  cargo test --doc --workspace --all-features --locked
  cargo nextest run --workspace --all-features --locked --no-fail-fast
else
  echo "cargo-nextest not found; using cargo test (install it: cargo install cargo-nextest --locked)" >&2
  cargo test --workspace --all-features --locked --no-fail-fast
fi
