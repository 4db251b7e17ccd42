#!/usr/bin/env bash
# The API contract (buf.yaml at the root, module proto/):
#   1. buf lint (STANDARD rules);
#   2. buf breaking (WIRE_JSON) against the last release: the tag when the
#      checkout has it, else that release's image in proto/releases/ (a
#      shallow or exported checkout has no tags); then a deliberate break,
#      which the check must refuse, so it is known to bite;
#   3. buf generate with buf.gen.yaml's local plugins (Python, TypeScript);
#      the Python stubs are imported and the TypeScript type-checked.
# Tools it lacks are installed: buf and protoc-gen-es from npm into
# target/tools, protoc and grpc_python_plugin from Debian (as root).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "check-proto: $*" >&2; }

tools=target/tools
export PATH="$PWD/$tools/node_modules/.bin:$PATH"
if ! command -v buf >/dev/null || ! command -v protoc-gen-es >/dev/null || ! command -v tsc >/dev/null; then
  command -v npm >/dev/null 2>&1 || { say "needs npm (apt-get install -y npm)"; exit 1; }
  say "installing buf and protoc-gen-es from npm into $tools"
  npm install --silent --no-audit --no-fund --prefix "$tools" \
    @bufbuild/buf@1 @bufbuild/protoc-gen-es@2 typescript@5 >&2
fi
if ! command -v protoc >/dev/null || ! command -v grpc_python_plugin >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing protoc and grpc_python_plugin (apt-get install protobuf-compiler protobuf-compiler-grpc)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q protobuf-compiler protobuf-compiler-grpc >/dev/null
  else
    say "needs protoc and grpc_python_plugin: sudo apt-get install -y protobuf-compiler protobuf-compiler-grpc"
    exit 1
  fi
fi

# 1. Lint.
buf lint
echo "buf lint: proto/ is clean"

# 2. No breaking change since the last release.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
release=$(git describe --tags --abbrev=0 --match 'v[0-9]*' 2>/dev/null || true)
if [ -n "$release" ]; then
  # The tag's contract, as files: plain git, so worktrees and any clone work.
  mkdir "$scratch/released"
  git archive "$release" buf.yaml proto | tar -x -C "$scratch/released"
  against="$scratch/released"
else
  image=$(ls proto/releases/v*.binpb 2>/dev/null | sort -V | tail -n 1)
  [ -n "$image" ] || { say "no release tag and no image in proto/releases/"; exit 1; }
  release=$(basename "$image" .binpb)
  against="$image"
  say "no release tag in this checkout: checking against $image"
fi
[ -f "proto/releases/$release.binpb" ] ||
  { say "proto/releases/$release.binpb is missing: buf build '.git#tag=$release' -o proto/releases/$release.binpb"; exit 1; }
# The image stands in for the tag where a checkout has no tags: it must be the tag's.
if [ "$against" != "proto/releases/$release.binpb" ]; then
  buf build "$against" -o "$scratch/tag.binpb"
  buf breaking "proto/releases/$release.binpb" --against "$scratch/tag.binpb" >/dev/null
  buf breaking "$scratch/tag.binpb" --against "proto/releases/$release.binpb" >/dev/null
fi
buf breaking --against "$against"
echo "buf breaking: no breaking change since $release"

# A field renumbered in a copy of the contract must be refused.
cp -r proto "$scratch/proto"
cp buf.yaml "$scratch/"
sed -i '0,/  string key = [0-9]*;/s//  string key = 99;/' "$scratch/proto/idempotency/v1/idempotency.proto"
if (cd "$scratch" && buf breaking --against "$OLDPWD/proto/releases/$release.binpb") >/dev/null 2>&1; then
  say "buf breaking accepted a renumbered field: the check does not work"
  exit 1
fi
echo "buf breaking: refuses a renumbered field, as it must"

# 3. Stubs for other languages from buf.gen.yaml, checked where they land.
rm -rf "$tools/gen"
buf generate -o "$tools"
tsc --noEmit --strict --skipLibCheck --target es2022 --module nodenext --moduleResolution nodenext \
  "$tools/gen/es/idempotency/v1/idempotency_pb.ts"
venv="$tools/proto-venv"
if [ ! -x "$venv/bin/python" ]; then
  say "creating $venv (protobuf, grpcio from PyPI)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check protobuf grpcio >&2
fi
(cd "$tools/gen/python" && "$OLDPWD/$venv/bin/python" -c '
import idempotency.v1.idempotency_pb2 as api, idempotency.v1.idempotency_pb2_grpc as rpc
assert "Acquire" in api.DESCRIPTOR.services_by_name["IdempotencyService"].methods_by_name
assert rpc.IdempotencyServiceStub')
echo "buf generate: Python stubs import, TypeScript type-checks ($tools/gen)"
