#!/usr/bin/env python3
"""`helm lint --strict` and `helm template`, without a helm binary.

Uses helm-python-sdk (module helm_python: Helm v4's Go SDK behind a C ABI),
installed by scripts/install-deploy-tools.sh into target/tools/venv:

    target/tools/venv/bin/python deploy/tools/helm.py lint CHART [-f VALUES]...
    target/tools/venv/bin/python deploy/tools/helm.py template RELEASE CHART \
        [-f VALUES]... [-n NAMESPACE] [--split DIR] [--notes FILE]

lint exits 1 when Helm reports a warning or an error (strict, as
`helm lint --strict`). template checks the values against values.schema.json,
renders the chart as a first install, and prints the manifests as
`helm template` does (hooks included, NOTES.txt left out); --split also writes
each document to DIR/NN-Kind-name.yaml, and --notes writes the rendered NOTES.txt.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

import helm_python
import yaml

SEVERITY = {0: "UNKNOWN", 1: "INFO", 2: "WARNING", 3: "ERROR"}


def load_values(files: list[str]) -> dict[str, Any]:
    """Parses and merges -f files like helm: later files win, maps merge deeply."""
    merged: dict[str, Any] = {}
    for file in files:
        merge_into(merged, helm_python.values_from_yaml(Path(file).read_text()))
    return merged


def merge_into(base: dict[str, Any], override: dict[str, Any]) -> None:
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge_into(base[key], value)
        else:
            base[key] = value


def lint(args: argparse.Namespace) -> int:
    values = load_values(args.values)
    report = helm_python.lint(
        args.chart, values or None, strict=True, namespace=args.namespace, kube_version=args.kube_version
    )
    failed = bool(report.get("errors"))
    for message in report.get("messages", []):
        severity = message.get("severity", 0)
        print(f"[{SEVERITY.get(severity, severity)}] {message.get('path')}: {message.get('error')}")
        failed |= severity >= 2
    for error in report.get("errors", []):
        print(f"[ERROR] {error}")
    linted = report.get("total_charts_linted", 0)
    if linted < 1:
        print("[ERROR] no chart was linted")
        failed = True
    print(f"{linted} chart(s) linted, {'failed' if failed else 'no failures'}")
    return 1 if failed else 0


def document_name(index: int, document: dict[str, Any]) -> str:
    kind = document.get("kind", "Unknown")
    name = (document.get("metadata") or {}).get("name", "unnamed")
    return f"{index:02d}-{kind}-{re.sub(r'[^A-Za-z0-9.-]', '_', name)}.yaml"


def template(args: argparse.Namespace) -> int:
    values = load_values(args.values)
    helm_python.validate_release_name(args.release)
    with helm_python.Chart.load(args.chart) as chart:
        # helm install and helm template check the coalesced values against the schema.
        chart.validate_schema(chart.merge_values(values))
        rendered = chart.render(values, name=args.release, namespace=args.namespace, is_install=True)
    out: list[str] = []
    documents: list[dict[str, Any]] = []
    notes = None
    for path in sorted(rendered):
        text = rendered[path]
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        for part in re.split(r"(?m)^---\s*$", text):
            if not part.strip():
                continue
            document = yaml.safe_load(part)
            if document is None:  # only comments
                continue
            if not isinstance(document, dict):
                raise SystemExit(f"{path}: a rendered document is not a mapping")
            documents.append(document)
            out.append(f"---\n# Source: {path}\n{part.strip()}\n")
    sys.stdout.write("".join(out))
    if args.split:
        directory = Path(args.split)
        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob("*.yaml"):
            old.unlink()
        for index, document in enumerate(documents, 1):
            (directory / document_name(index, document)).write_text(
                yaml.safe_dump(document, sort_keys=False)
            )
    if args.notes is not None:
        if not notes or not notes.strip():
            raise SystemExit("NOTES.txt rendered empty")
        Path(args.notes).write_text(notes)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    lint_parser = commands.add_parser("lint", help="helm lint --strict")
    lint_parser.add_argument("chart")
    lint_parser.add_argument("-f", "--values", action="append", default=[])
    lint_parser.add_argument("-n", "--namespace", default="default")
    lint_parser.add_argument("--kube-version", default=None, help="e.g. v1.31.0")
    lint_parser.set_defaults(run=lint)

    template_parser = commands.add_parser("template", help="helm template (as a first install)")
    template_parser.add_argument("release")
    template_parser.add_argument("chart")
    template_parser.add_argument("-f", "--values", action="append", default=[])
    template_parser.add_argument("-n", "--namespace", default="default")
    template_parser.add_argument("--split", metavar="DIR", help="also write one file per document")
    template_parser.add_argument("--notes", metavar="FILE", help="write the rendered NOTES.txt")
    template_parser.set_defaults(run=template)

    args = parser.parse_args()
    try:
        return args.run(args)
    except helm_python.HelmError as error:
        print(f"helm: {type(error).__name__}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(main())
