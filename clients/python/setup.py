"""Build hook: generates the protobuf and gRPC stubs from the repository's
``proto/`` into ``idempotency_client/_pb`` while the package is built, so that
the stubs always match the proto and are never committed.

``google/rpc/status.proto`` is read to compile the service's proto but its
module is not generated: ``google.rpc.status_pb2`` comes from
googleapis-common-protos, which many packages (grpcio-status, OpenTelemetry's
OTLP exporter, Google's clients) install. Two modules registering the same
proto file would make the second import fail ("duplicate file name").

The proto files are looked up in ``$IDEMPOTENCY_PROTO_DIR``, then beside this
file (``proto/``, where an sdist carries them), then at the repository's root
(``../../proto``, for ``pip install ./clients/python``).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
PROTOS = ["idempotency/v1/idempotency.proto", "google/rpc/status.proto"]
GENERATED = ["idempotency/v1/idempotency.proto"]
# The generated modules import each other by their proto package; inside
# this package they live under idempotency_client._pb.
IMPORTS = re.compile(r"^(from|import) (idempotency\.v1)\b", re.MULTILINE)


def proto_dir() -> Path:
    candidates = [os.environ.get("IDEMPOTENCY_PROTO_DIR"), HERE / "proto", HERE.parent.parent / "proto"]
    for candidate in candidates:
        if candidate and all((Path(candidate) / proto).is_file() for proto in PROTOS):
            return Path(candidate)
    raise SystemExit(
        "idempotency-client: the proto files were not found; build from the repository "
        "(pip install ./clients/python) or set IDEMPOTENCY_PROTO_DIR"
    )


def generate(out: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    source = proto_dir()
    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    shutil.rmtree(out, ignore_errors=True)  # nothing stale from an earlier build
    out.mkdir(parents=True)
    args = [
        "grpc_tools.protoc",
        f"-I{source}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *GENERATED,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"idempotency-client: protoc failed on {source}")
    for path in out.rglob("*.py*"):
        text = path.read_text(encoding="utf-8")
        path.write_text(IMPORTS.sub(r"\1 idempotency_client._pb.\2", text), encoding="utf-8")
    for folder in [out, *(p for p in out.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()


def requirements() -> list:
    """grpcio and protobuf no older than the generated code asks for (the
    stubs refuse to load on an older runtime), and google.rpc's modules."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stubs = "".join(path.read_text(encoding="utf-8") for path in Path(tmp).rglob("*.py"))
    grpc_version = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", stubs)
    protobuf_version = re.search(r"ValidateProtobufRuntimeVersion\(\s*[\w.]+,\s*(\d+),\s*(\d+),\s*(\d+),", stubs)
    grpcio = f"grpcio>={grpc_version.group(1)}" if grpc_version else "grpcio"
    protobuf = "protobuf>=" + ".".join(protobuf_version.groups()) if protobuf_version else "protobuf"
    return [grpcio, protobuf, "googleapis-common-protos>=1.56"]


class BuildPyWithStubs(build_py):
    """build_py that first writes the generated stubs into the build tree."""

    def run(self) -> None:
        super().run()
        if not self.dry_run:
            generate(Path(self.build_lib) / "idempotency_client" / "_pb")


class SdistWithProtos(sdist):
    """An sdist that carries the proto files, so that it builds on its own."""

    def make_release_tree(self, base_dir: str, files: list) -> None:
        super().make_release_tree(base_dir, files)
        source = proto_dir()
        for proto in PROTOS:
            target = Path(base_dir) / "proto" / proto
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / proto, target)


setup(
    install_requires=requirements(),
    cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProtos},
)
