#!/usr/bin/env bash
# Checks everything under deploy/: the Helm chart, the alert rules and their
# tests. Installs its tools first (scripts/install-deploy-tools.sh), so a fresh
# machine needs no manual step. No cluster, no Docker, no helm binary needed.
#
# For the chart's default values and for every file in
# deploy/helm/idempotency/ci/ (a "case"):
#   - helm lint --strict                 (deploy/tools/helm.py, helm-python-sdk)
#   - helm template, schema included     (same)
#   - kubernetes-validate --strict -k $KUBE_VERSION on every rendered manifest,
#     except the CRD kinds of the Prometheus Operator (ServiceMonitor,
#     PrometheusRule) and of cert-manager (Certificate), for which it ships no
#     schema: those are skipped by name and said so; the PrometheusRule's rules
#     go through promtool, and check_manifests.py checks the Certificate's essentials
#   - deploy/tools/check_manifests.py: how the manifests fit together (with
#     default values it also requires the NetworkPolicy, which is on by default)
# and once:
#   - every value in values.yaml has a comment above it
#   - the two copies of the alert rules are identical
#   - the PrometheusRule rendered with default values has exactly those rules
#   - promtool check rules, promtool test rules; promtool parses every dashboard query
#   - alerts and dashboard query only metrics the service exports
#   - values the chart must refuse (inconsistent security settings among them)
#   - editing the auth policy or the JWKS leaves the pods as they are (the
#     server re-reads those files; a pod template change would roll them)
#
# Prints one line per check and a summary; exits 1 when any check failed.
# Work files go to target/deploy-check/.
set -uo pipefail
cd "$(dirname "$0")/.."

KUBE_VERSION=${KUBE_VERSION:-1.31.0}
CHART=deploy/helm/idempotency
VENV=target/tools/venv
PY=$VENV/bin/python
OUT=target/deploy-check
SKIPPED_KINDS="ServiceMonitor PrometheusRule Certificate"
RELEASE=idempotency
NAMESPACE=idempotency

started=$(date +%s)
passed=0
failed=0
failed_names=()

# run NAME COMMAND...: runs a check, keeps its output in $OUT/logs, prints one line.
run() {
  local title=$1
  shift
  local log
  log="$OUT/logs/$(printf '%02d' $((passed + failed + 1)))-$(echo "$title" | tr -c 'A-Za-z0-9._-' '_' | cut -c1-80).log"
  local t0=$SECONDS
  if "$@" >"$log" 2>&1; then
    passed=$((passed + 1))
    printf 'ok    %-92s %3ss\n' "$title" $((SECONDS - t0))
  else
    failed=$((failed + 1))
    failed_names+=("$title")
    printf 'FAIL  %-92s %3ss\n' "$title" $((SECONDS - t0))
    sed 's/^/      | /' "$log" | tail -n 40
    return 1
  fi
}

scripts/install-deploy-tools.sh || { echo "FAIL  installing the tools (scripts/install-deploy-tools.sh)"; exit 1; }

rm -rf "$OUT"
mkdir -p "$OUT/logs"

# kubernetes-validate on every rendered manifest but the CRD kinds; its
# warnings (e.g. "no schema for this kind") count as failures.
validate_case() {
  local dir=$1 files=() file kind skipped=()
  for file in "$dir"/*.yaml; do
    kind=$(basename "$file" | cut -d- -f2)
    case " $SKIPPED_KINDS " in
      *" $kind "*) skipped+=("$(basename "$file")") ;;
      *) files+=("$file") ;;
    esac
  done
  for file in "${skipped[@]}"; do
    echo "skipped (CRD kind, no built-in schema; checked by check_manifests.py and promtool): $file"
  done
  [ ${#files[@]} -gt 0 ] || { echo "no manifests to validate"; return 1; }
  local output rc
  output=$("$VENV/bin/kubernetes-validate" --strict -k "$KUBE_VERSION" "${files[@]}" 2>&1)
  rc=$?
  echo "$output"
  [ $rc -eq 0 ] || return 1
  if grep -qE '^(WARN|ERROR|FATAL)' <<<"$output"; then return 1; fi
  echo "${#files[@]} manifests valid against Kubernetes $KUBE_VERSION (strict)"
}

run "values.yaml: a comment above every value" \
  "$PY" deploy/tools/check_manifests.py values-doc "$CHART/values.yaml"

cases=(default)
for file in "$CHART"/ci/*.yaml; do
  cases+=("$(basename "$file" .yaml)")
done

for case in "${cases[@]}"; do
  values=()
  [ "$case" = default ] || values=(-f "$CHART/ci/$case.yaml")
  dir=$OUT/$case
  run "helm lint --strict ($case)" \
    "$PY" deploy/tools/helm.py lint "$CHART" "${values[@]}" -n "$NAMESPACE" --kube-version "v$KUBE_VERSION"
  if run "helm template ($case)" \
    "$PY" deploy/tools/helm.py template "$RELEASE" "$CHART" "${values[@]}" -n "$NAMESPACE" \
    --split "$dir" --notes "$OUT/$case-NOTES.txt"; then
    # The rendered manifests in one file, for reading.
    for part in "$dir"/*.yaml; do printf -- '---\n'; cat "$part"; done >"$OUT/$case.yaml"
    run "kubernetes-validate --strict -k $KUBE_VERSION ($case; skips $SKIPPED_KINDS)" validate_case "$dir"
    rules_args=(--rules-out "$OUT/$case-rules.yaml")
    [ "$case" = monitoring-values ] && rules_args+=(--expect-rules deploy/prometheus/alerts.yaml)
    [ "$case" = default ] && rules_args+=(--expect-network-policy)
    run "manifests fit together ($case)" \
      "$PY" deploy/tools/check_manifests.py manifests "$dir" "${rules_args[@]}"
    if [ -s "$OUT/$case-rules.yaml" ]; then
      run "promtool check rules on the PrometheusRule ($case)" promtool check rules "$OUT/$case-rules.yaml"
    fi
  fi
done

# Values the server would refuse (or that would kill pods mid-drain) fail at
# render time, with a message naming them.
refuses() { # values-file expected-message
  local output
  if output=$("$PY" deploy/tools/helm.py template "$RELEASE" "$CHART" -f "$1" -n "$NAMESPACE" 2>&1); then
    echo "rendered, but should have been refused"
    return 1
  fi
  grep -qF -- "$2" <<<"$output" || { echo "$output"; echo "refused, but without: $2"; return 1; }
  echo "refused: $2"
}
printf 'config:\n  dbMaxConnections: 4\n  batchWorkers: 2\n' >"$OUT/refuse-small-pool.yaml"
run "chart refuses a pool its batch workers would fill" \
  refuses "$OUT/refuse-small-pool.yaml" "must be more than 4 (2 x config.batchWorkers)"
printf 'terminationGracePeriodSeconds: 10\nconfig:\n  drainTimeout: 20s\n' >"$OUT/refuse-short-grace.yaml"
run "chart refuses a grace period shorter than the drain" \
  refuses "$OUT/refuse-short-grace.yaml" "must exceed config.drainTimeout"
printf 'terminationGracePeriodSeconds: 30\nconfig:\n  drainTimeout: 29500ms\n' >"$OUT/refuse-ms-grace.yaml"
run "chart refuses a grace period a drain in milliseconds would outlast" \
  refuses "$OUT/refuse-ms-grace.yaml" "must exceed config.drainTimeout"
printf 'replicaCount: 1\nautoscaling:\n  enabled: false\n' >"$OUT/refuse-blocked-drain.yaml"
run "chart refuses a disruption budget that blocks node drains" \
  refuses "$OUT/refuse-blocked-drain.yaml" "must be less than the fewest pods (1)"
printf 'ports:\n  health: 50051\n' >"$OUT/refuse-same-ports.yaml"
run "chart refuses a health port that is the gRPC port" \
  refuses "$OUT/refuse-same-ports.yaml" "and ports.health (50051) must differ"

# Security settings: each a combination the server refuses, or one that would
# leave the service open, unreachable or tokens in clear text without a word.
GRANT='[[grant]]\n      principals = ["system:serviceaccount:payments:*"]\n      namespaces = ["payments"]\n      role = "caller"\n'
printf 'tls:\n  clientAuth:\n    enabled: true\n' >"$OUT/refuse-mtls-without-tls.yaml"
run "chart refuses client certificates without TLS" \
  refuses "$OUT/refuse-mtls-without-tls.yaml" "tls.clientAuth.enabled needs tls.enabled"
printf 'tls:\n  enabled: true\n' >"$OUT/refuse-tls-without-secret.yaml"
run "chart refuses TLS without a Secret or cert-manager" \
  refuses "$OUT/refuse-tls-without-secret.yaml" "tls.enabled needs tls.secretName"
printf 'tls:\n  enabled: true\n  certManager:\n    enabled: true\n' >"$OUT/refuse-issuerless.yaml"
run "chart refuses a cert-manager Certificate without an issuer" \
  refuses "$OUT/refuse-issuerless.yaml" "tls.certManager.issuerRef.name is required"
printf 'tls:\n  certManager:\n    enabled: true\n    issuerRef:\n      name: ca\n' >"$OUT/refuse-cert-without-tls.yaml"
run "chart refuses a cert-manager Certificate with TLS off" \
  refuses "$OUT/refuse-cert-without-tls.yaml" "tls.certManager.enabled needs tls.enabled"
printf 'tls:\n  enabled: true\n  secretName: idem-tls\n  clientAuth:\n    enabled: true\n' >"$OUT/refuse-policyless.yaml"
run "chart refuses authentication without a policy" \
  refuses "$OUT/refuse-policyless.yaml" "auth.policy (inline or existingConfigMap) is required"
printf "auth:\n  policy:\n    inline: |\n      $GRANT" >"$OUT/refuse-policy-only.yaml"
run "chart refuses a policy no caller can be named by" \
  refuses "$OUT/refuse-policy-only.yaml" "auth.policy is set but no caller can prove who it is"
printf "tls:\n  enabled: true\n  secretName: idem-tls\nauth:\n  jwt:\n    enabled: true\n    issuer: https://kubernetes.default.svc.cluster.local\n    jwks:\n      existingConfigMap: cluster-jwks\n  policy:\n    inline: |\n      $GRANT" >"$OUT/refuse-jwt-audience.yaml"
run "chart refuses JWTs without an audience" \
  refuses "$OUT/refuse-jwt-audience.yaml" "auth.jwt.enabled needs auth.jwt.issuer and auth.jwt.audience"
printf "tls:\n  enabled: true\n  secretName: idem-tls\nauth:\n  jwt:\n    enabled: true\n    issuer: https://kubernetes.default.svc.cluster.local\n    audience: idempotency\n    jwks:\n      inline: '{\"kty\": \"RSA\"}'\n  policy:\n    inline: |\n      $GRANT" >"$OUT/refuse-jwks.yaml"
run "chart refuses an inline JWKS without keys" \
  refuses "$OUT/refuse-jwks.yaml" "auth.jwt.jwks.inline is not a JWKS"
printf "auth:\n  staticTokens:\n    existingSecret: idem-tokens\n  policy:\n    inline: |\n      $GRANT" >"$OUT/refuse-plaintext-tokens.yaml"
run "chart refuses bearer tokens without TLS" \
  refuses "$OUT/refuse-plaintext-tokens.yaml" "bearer tokens would cross the network in clear text"
printf 'tls:\n  enabled: true\n  secretName: idem-tls\n  clientAuth:\n    enabled: true\nauth:\n  policy:\n    inline: |\n      [[grant]]\n      principals = ["spiffe://cluster.local/ns/payments/sa/api"]\n      namespaces = ["payments"]\n      role = "owner"\n' >"$OUT/refuse-policy-role.yaml"
run "chart refuses a policy grant with an unknown role" \
  refuses "$OUT/refuse-policy-role.yaml" "grant 1 has role owner; the roles are caller, reader and admin"
printf 'tls:\n  enabled: true\n  secretName: idem-tls\n  clientAuth:\n    enabled: true\nauth:\n  policy:\n    inline: |\n      [[grant]\n      role = "caller"\n' >"$OUT/refuse-policy-toml.yaml"
run "chart refuses a policy that is not TOML" \
  refuses "$OUT/refuse-policy-toml.yaml" "auth.policy.inline is not valid TOML"

# The server re-reads the policy and the JWKS: editing them must change their
# ConfigMaps and leave the pod template (and so the running pods) alone.
edit_keeps_pods() {
  local base=$OUT/security-values edited=$OUT/security-values-edited
  printf 'auth:\n  policy:\n    inline: |\n      [[grant]]\n      principals = ["system:serviceaccount:checkout:*"]\n      namespaces = ["checkout"]\n      role = "caller"\n  jwt:\n    jwks:\n      inline: |\n        {"keys": [{"kty": "EC", "kid": "rotated", "crv": "P-256", "x": "f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU", "y": "x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"}]}\n' >"$OUT/edit-policy-jwks.yaml"
  [ -d "$base" ] || { echo "case security-values was not rendered"; return 1; }
  "$PY" deploy/tools/helm.py template "$RELEASE" "$CHART" -f "$CHART/ci/security-values.yaml" -f "$OUT/edit-policy-jwks.yaml" \
    -n "$NAMESPACE" --split "$edited" >/dev/null || return 1
  local kind file changed=0
  for kind in Deployment ConfigMap-idempotency.yaml; do
    for file in "$base"/*-"$kind"*; do
      diff -u "$file" "$edited/$(basename "$file")" || { echo "changed: $(basename "$file")"; return 1; }
    done
  done
  for file in "$base"/*-ConfigMap-idempotency-auth-policy.yaml "$base"/*-ConfigMap-idempotency-jwks.yaml; do
    cmp -s "$file" "$edited/$(basename "$file")" && { echo "the edit did not reach $(basename "$file")"; return 1; }
    changed=$((changed + 1))
  done
  echo "the policy and JWKS ConfigMaps changed ($changed), the Deployment and the settings did not"
}
run "editing the auth policy or the JWKS does not roll the pods" edit_keeps_pods

same_rules() {
  [ -f deploy/prometheus/alerts.yaml ] || { echo "deploy/prometheus/alerts.yaml is missing"; return 1; }
  cmp deploy/prometheus/alerts.yaml "$CHART/files/alerts.yaml" &&
    echo "deploy/prometheus/alerts.yaml and $CHART/files/alerts.yaml are identical"
}
run "alert rules: deploy/prometheus/alerts.yaml = $CHART/files/alerts.yaml" same_rules
[ -s "$OUT/monitoring-values-rules.yaml" ] ||
  run "PrometheusRule rendered with default values" false
run "promtool check rules deploy/prometheus/alerts.yaml" promtool check rules deploy/prometheus/alerts.yaml
run "promtool test rules deploy/prometheus/alerts_test.yaml" promtool test rules deploy/prometheus/alerts_test.yaml
dashboard_queries() {
  "$PY" deploy/tools/check_manifests.py dashboard-rules "$CHART/files/dashboard.json" "$OUT/dashboard-rules.yaml" &&
    promtool check rules "$OUT/dashboard-rules.yaml"
}
run "promtool parses every dashboard query" dashboard_queries
run "alerts and dashboard use only exported metrics" \
  "$PY" deploy/tools/check_manifests.py catalogue deploy/prometheus/alerts.yaml "$CHART/files/dashboard.json"

echo "took $(($(date +%s) - started))s; logs and rendered manifests in $OUT/"
if [ "$failed" -gt 0 ]; then
  printf 'failed: %s\n' "${failed_names[@]}"
fi
echo "check-deploy: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
