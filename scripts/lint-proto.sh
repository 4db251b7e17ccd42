#!/usr/bin/env bash
# Lints the API contract with buf (STANDARD rules). buf comes from the npm
# registry; when it is not on PATH it is installed into target/tools.
set -euo pipefail
cd "$(dirname "$0")/.."

buf=$(command -v buf || true)
if [ -z "$buf" ]; then
  buf=target/tools/node_modules/.bin/buf
  if [ ! -x "$buf" ]; then
    command -v npm >/dev/null 2>&1 || { echo "lint-proto: needs buf or npm (apt-get install -y npm)" >&2; exit 1; }
    echo "lint-proto: installing buf from npm into target/tools" >&2
    npm install --silent --no-audit --no-fund --prefix target/tools @bufbuild/buf@1 >&2
  fi
fi
"$buf" lint proto
echo "buf lint: proto/ is clean"
