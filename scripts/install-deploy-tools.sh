#!/usr/bin/env bash
# Installs the tools scripts/check-deploy.sh needs. Idempotent: a second run
# only checks that everything is there and prints what it found.
#
#  - target/tools/venv: a Python virtual environment with
#      helm-python-sdk  (Helm's lint and template, as a library: no helm binary)
#      kubernetes-validate  (JSON-schema validation of Kubernetes manifests)
#  - promtool, from Debian's `prometheus` package (installed with apt-get when
#    missing; needs root, which every machine of this project has).
#
# Everything is reported on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

HELM_PYTHON_SDK_VERSION=0.2.2
KUBERNETES_VALIDATE_VERSION=1.37.0
VENV=target/tools/venv

say() { printf 'install-deploy-tools: %s\n' "$*" >&2; }

# --- Python packages ---------------------------------------------------------
venv_ok() {
  [ -x "$VENV/bin/python" ] &&
    "$VENV/bin/python" - "$HELM_PYTHON_SDK_VERSION" "$KUBERNETES_VALIDATE_VERSION" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
assert version("helm-python-sdk") == sys.argv[1], "helm-python-sdk"
assert version("kubernetes-validate") == sys.argv[2], "kubernetes-validate"
import helm_python, kubernetes_validate  # noqa: F401  (both must import)
EOF
}

if venv_ok; then
  say "python tools present in $VENV (helm-python-sdk==$HELM_PYTHON_SDK_VERSION, kubernetes-validate==$KUBERNETES_VALIDATE_VERSION)"
else
  if ! "$VENV/bin/python" -c 'pass' >/dev/null 2>&1; then
    # Debian's own python3 needs python3-venv for `-m venv` (ensurepip).
    if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
      say "python3 has no venv/ensurepip: apt-get install python3-venv"
      apt-get update >&2
      DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-venv >&2
    fi
    say "creating virtual environment $VENV"
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV"
  fi
  say "pip install helm-python-sdk==$HELM_PYTHON_SDK_VERSION kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    "helm-python-sdk==$HELM_PYTHON_SDK_VERSION" \
    "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" >&2
  venv_ok || { say "the python tools still do not import after pip install"; exit 1; }
  say "python tools installed in $VENV"
fi

# --- promtool ----------------------------------------------------------------
if command -v promtool >/dev/null 2>&1; then
  say "promtool present: $(command -v promtool) ($(promtool --version 2>&1 | head -n 1))"
else
  if [ "$(id -u)" -ne 0 ]; then
    say "promtool is missing and this is not root: run 'apt-get install prometheus' as root"
    exit 1
  fi
  say "promtool missing: apt-get update && apt-get install -y --no-install-recommends prometheus"
  # The package's maintainer scripts would start a Prometheus server; we only
  # want its promtool. A policy-rc.d answering 101 tells invoke-rc.d not to
  # start services. Only ours is removed again.
  policy=/usr/sbin/policy-rc.d
  created_policy=""
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 0755 "$policy"
    created_policy=1
  fi
  cleanup_policy() { if [ -n "$created_policy" ]; then rm -f "$policy"; fi; }
  trap cleanup_policy EXIT
  apt-get update >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus >&2
  cleanup_policy
  created_policy=""
  trap - EXIT
  command -v promtool >/dev/null 2>&1 || { say "promtool still missing after installing prometheus"; exit 1; }
  say "promtool installed: $(command -v promtool) ($(promtool --version 2>&1 | head -n 1))"
fi
