#!/usr/bin/env python3
"""What a schema cannot see in the chart's rendered manifests.

    check_manifests.py manifests DIR [--rules-out FILE] [--expect-rules FILE]
    check_manifests.py catalogue ALERTS_FILE DASHBOARD_JSON
    check_manifests.py values-doc VALUES_YAML

`manifests` reads the documents `helm.py template --split DIR` wrote and
checks how they fit together: selectors and port names match, every pod is
hardened, the grace period covers the drain, the migration hook references
nothing the install has not created yet, the CronJob and the in-process
reaper exclude each other, and every setting in the ConfigMap is one
idempotencyd reads (from server/src). With --rules-out it writes the
PrometheusRule's groups as a plain rules file (for promtool); with
--expect-rules it also requires them to equal that rules file.

`catalogue` checks that every idempotency_* metric the alerts and the
dashboard query is one the service exports (from server/src).

`values-doc` checks that every value in values.yaml has a comment line
right above it (entries of list values, which are examples, excepted).

Prints one line per finding and exits 1 when any check failed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Iterator

import yaml

ROOT = Path(__file__).resolve().parents[2]
SERVER_SRC = ROOT / "server" / "src"
UID = 65532
HOOK_EVENTS = {"pre-install", "pre-upgrade"}

failures: list[str] = []


def fail(message: str) -> None:
    failures.append(message)
    print(f"  FAIL {message}")


def check(condition: bool, message: str) -> bool:
    if not condition:
        fail(message)
    return condition


# --- facts from the service's source -------------------------------------------


def server_sources() -> str:
    files = sorted(SERVER_SRC.rglob("*.rs"))
    if not files:
        raise SystemExit(f"no Rust sources under {SERVER_SRC}: cannot read the service's settings and metrics")
    return "\n".join(path.read_text() for path in files)


def known_settings() -> set[str]:
    names = set(re.findall(r'env\s*=\s*"([A-Z][A-Z0-9_]*)"', server_sources()))
    if "DATABASE_URL" not in names:
        raise SystemExit("server/src declares no DATABASE_URL setting: has settings.rs moved?")
    return names


def known_metrics() -> set[str]:
    names = set(re.findall(r'"(idempotency_[a-z0-9_]+)"', server_sources()))
    if "idempotency_requests_total" not in names:
        raise SystemExit("server/src names no idempotency_requests_total metric: has metrics.rs moved?")
    return names


def unknown_metrics(exprs: list[str], known: set[str]) -> set[str]:
    used = {name for expr in exprs for name in re.findall(r"\bidempotency_[a-z0-9_]+", expr)}
    return {
        name
        for name in used
        if name not in known and re.sub(r"_(bucket|sum|count)$", "", name) not in known
    }


# --- manifests ------------------------------------------------------------------


def load(directory: Path) -> list[dict[str, Any]]:
    documents = [yaml.safe_load(path.read_text()) for path in sorted(directory.glob("*.yaml"))]
    if not documents:
        raise SystemExit(f"no manifests in {directory}")
    return documents


def of_kind(documents: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in documents if d.get("kind") == kind]


def name(document: dict[str, Any]) -> str:
    return f"{document['kind']}/{document['metadata']['name']}"


def annotations(document: dict[str, Any]) -> dict[str, str]:
    return document.get("metadata", {}).get("annotations") or {}


def hook_events(document: dict[str, Any]) -> set[str]:
    value = annotations(document).get("helm.sh/hook", "")
    return {event.strip() for event in value.split(",") if event.strip()}


def hook_weight(document: dict[str, Any]) -> int:
    return int(annotations(document).get("helm.sh/hook-weight", "0"))


def pod_specs(documents: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template) of every Deployment, Job and CronJob."""
    for document in documents:
        kind = document.get("kind")
        if kind in ("Deployment", "Job"):
            yield document, document["spec"]["template"]
        elif kind == "CronJob":
            yield document, document["spec"]["jobTemplate"]["spec"]["template"]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def duration_seconds(text: str) -> float | None:
    units = {"ms": 0.001, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800}
    parts = re.findall(r"(\d+)\s*([a-z]+)", text)
    if not parts or re.sub(r"[\d\sa-z]", "", text):
        return None
    total = 0.0
    for number, unit in parts:
        if unit not in units:
            return None
        total += int(number) * units[unit]
    return total


def check_hardening(documents: list[dict[str, Any]]) -> None:
    for workload, template in pod_specs(documents):
        spec = template["spec"]
        pod = spec.get("securityContext") or {}
        check(pod.get("runAsNonRoot") is True, f"{name(workload)}: pod securityContext.runAsNonRoot is not true")
        check(spec.get("automountServiceAccountToken") is False, f"{name(workload)}: mounts a ServiceAccount token")
        for container in spec["containers"]:
            where = f"{name(workload)} container {container['name']}"
            sc = container.get("securityContext") or {}
            check(sc.get("runAsNonRoot") is True, f"{where}: runAsNonRoot is not true")
            check(sc.get("runAsUser", pod.get("runAsUser")) == UID, f"{where}: does not run as user {UID}")
            check(sc.get("readOnlyRootFilesystem") is True, f"{where}: root filesystem is writable")
            check(sc.get("allowPrivilegeEscalation") is False, f"{where}: allows privilege escalation")
            check("ALL" in ((sc.get("capabilities") or {}).get("drop") or []), f"{where}: does not drop ALL capabilities")
            seccomp = (sc.get("seccompProfile") or pod.get("seccompProfile") or {}).get("type")
            check(seccomp == "RuntimeDefault", f"{where}: seccomp profile is {seccomp!r}, not RuntimeDefault")
            resources = container.get("resources") or {}
            check(bool(resources.get("requests")) and bool(resources.get("limits", {}).get("memory")),
                  f"{where}: needs resource requests and a memory limit")


def secret_refs(container: dict[str, Any]) -> list[str]:
    refs = [
        env["valueFrom"]["secretKeyRef"]["name"]
        for env in container.get("env") or []
        if "secretKeyRef" in (env.get("valueFrom") or {})
    ]
    refs += [e["secretRef"]["name"] for e in container.get("envFrom") or [] if "secretRef" in e]
    return refs


def configmap_refs(container: dict[str, Any]) -> list[str]:
    refs = [e["configMapRef"]["name"] for e in container.get("envFrom") or [] if "configMapRef" in e]
    refs += [
        env["valueFrom"]["configMapKeyRef"]["name"]
        for env in container.get("env") or []
        if "configMapKeyRef" in (env.get("valueFrom") or {})
    ]
    return refs


def check_manifests(documents: list[dict[str, Any]], settings: set[str]) -> None:
    by_name = {name(d): d for d in documents}
    deployments = of_kind(documents, "Deployment")
    if not check(len(deployments) == 1, f"expected one Deployment, found {len(deployments)}"):
        return
    deployment = deployments[0]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    check(matches(deployment["spec"]["selector"]["matchLabels"], pod_labels),
          "Deployment selector does not match its pod labels")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container.get("ports") or []}
    check(set(ports) >= {"grpc", "metrics"}, f"Deployment container ports {sorted(ports)} lack grpc/metrics")

    strategy = deployment["spec"].get("strategy") or {}
    check(strategy.get("type") == "RollingUpdate" and strategy.get("rollingUpdate", {}).get("maxUnavailable") == 0,
          "Deployment rollout may take serving pods away (maxUnavailable is not 0)")

    readiness = container.get("readinessProbe") or {}
    check(readiness.get("grpc", {}).get("port") == ports.get("grpc"),
          "readiness is not the native gRPC probe on the gRPC port")
    check(bool(container.get("livenessProbe")), "the server has no liveness probe")

    # ConfigMap: every key a setting idempotencyd reads; the settings that tie to other manifests.
    configmaps = {d["metadata"]["name"]: d for d in of_kind(documents, "ConfigMap")}
    settings_map: dict[str, str] = {}
    for ref in configmap_refs(container):
        if check(ref in configmaps, f"Deployment reads ConfigMap {ref}, which the chart does not create"):
            settings_map.update(configmaps[ref].get("data") or {})
    unknown = sorted(set(settings_map) - settings)
    check(not unknown, f"ConfigMap keys idempotencyd does not read (see server/src/settings.rs): {unknown}")
    grace = pod.get("terminationGracePeriodSeconds", 30)
    drain = duration_seconds(settings_map.get("IDEMPOTENCY_DRAIN_TIMEOUT", "20s"))
    check(drain is not None and grace > drain,
          f"terminationGracePeriodSeconds {grace} does not exceed the drain timeout "
          f"{settings_map.get('IDEMPOTENCY_DRAIN_TIMEOUT')}")
    check(settings_map.get("IDEMPOTENCY_GRPC_ADDR", "").endswith(f":{ports.get('grpc')}"),
          "IDEMPOTENCY_GRPC_ADDR does not listen on the container's grpc port")
    check(settings_map.get("IDEMPOTENCY_METRICS_ADDR", "").endswith(f":{ports.get('metrics')}"),
          "IDEMPOTENCY_METRICS_ADDR does not listen on the container's metrics port")
    env_names = {e["name"] for e in container.get("env") or []}
    check("DATABASE_URL" in env_names, "the server gets no DATABASE_URL")

    # Services, PDB, HPA, NetworkPolicy, ServiceMonitor point at the pods.
    services = of_kind(documents, "Service")
    for service in services:
        check(matches(service["spec"]["selector"], pod_labels), f"{name(service)} selects no server pod")
        for port in service["spec"]["ports"]:
            check(port.get("targetPort") in ports or port.get("targetPort") in ports.values(),
                  f"{name(service)} port {port['name']} targets {port.get('targetPort')!r}, not a container port")
    check(any(p["name"] == "grpc" and p.get("appProtocol") == "grpc" for s in services for p in s["spec"]["ports"]),
          "no Service port named grpc with appProtocol grpc")
    for pdb in of_kind(documents, "PodDisruptionBudget"):
        check(matches(pdb["spec"]["selector"]["matchLabels"], pod_labels), f"{name(pdb)} selects no server pod")
    for hpa in of_kind(documents, "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        check(target["kind"] == "Deployment" and target["name"] == deployment["metadata"]["name"],
              f"{name(hpa)} scales {target['kind']}/{target['name']}")
        check("replicas" not in deployment["spec"], "Deployment sets replicas although an autoscaler owns them")
        check(hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"], f"{name(hpa)}: minReplicas > maxReplicas")
    if not of_kind(documents, "HorizontalPodAutoscaler"):
        check("replicas" in deployment["spec"], "no autoscaler and no replica count")
    for policy in of_kind(documents, "NetworkPolicy"):
        for _, template in pod_specs(documents):
            check(matches(policy["spec"]["podSelector"]["matchLabels"], template["metadata"]["labels"]),
                  f"{name(policy)} leaves some of the chart's pods unrestricted")
    for monitor in of_kind(documents, "ServiceMonitor"):
        selected = [s for s in services if matches(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
        service_ports = {p["name"] for s in selected for p in s["spec"]["ports"]}
        check(bool(selected), f"{name(monitor)} selects no Service")
        for endpoint in monitor["spec"]["endpoints"]:
            check(endpoint.get("port") in service_ports, f"{name(monitor)} scrapes port {endpoint.get('port')!r}, which no selected Service has")

    # Secrets and ConfigMaps every pod reads: created by the chart, or declared external.
    chart_secrets = {d["metadata"]["name"]: d for d in of_kind(documents, "Secret")}
    for workload, template in pod_specs(documents):
        for c in template["spec"]["containers"]:
            for ref in configmap_refs(c):
                check(ref in configmaps, f"{name(workload)} reads ConfigMap {ref}, which the chart does not create")

    # The migration hook runs before the release's own resources exist.
    for job in of_kind(documents, "Job"):
        events = hook_events(job)
        if not events:
            continue
        check(events == HOOK_EVENTS, f"{name(job)} is a hook on {sorted(events)}, not {sorted(HOOK_EVENTS)}")
        policy = annotations(job).get("helm.sh/hook-delete-policy", "")
        check({"before-hook-creation", "hook-succeeded"} <= set(policy.split(",")),
              f"{name(job)} hook-delete-policy is {policy!r}")
        spec = job["spec"]["template"]["spec"]
        account = spec.get("serviceAccountName")
        if account:
            sa = by_name.get(f"ServiceAccount/{account}")
            check(sa is None or bool(hook_events(sa)),
                  f"{name(job)} runs as ServiceAccount {account}, which the chart creates only after the hook")
        for c in spec["containers"]:
            check(c.get("args") == ["migrate"], f"{name(job)} runs {c.get('args')}, not migrate")
            check(not configmap_refs(c), f"{name(job)} reads a ConfigMap, which does not exist yet on install")
            for ref in secret_refs(c):
                secret = chart_secrets.get(ref)
                if secret is None:
                    continue  # an existing Secret, created before the install
                check(HOOK_EVENTS <= hook_events(secret) and hook_weight(secret) < hook_weight(job),
                      f"{name(job)} reads Secret {ref}, which is not a hook created before it")
    for workload, template in pod_specs(documents):
        if hook_events(workload):
            continue
        for c in template["spec"]["containers"]:
            for ref in secret_refs(c):
                if ref in chart_secrets:
                    check(not hook_events(chart_secrets[ref]),
                          f"{name(workload)} reads Secret {ref}, a hook that is deleted after the hooks ran")

    # Reaping: the CronJob or the pods, never both, never neither.
    cronjobs = of_kind(documents, "CronJob")
    in_process = settings_map.get("IDEMPOTENCY_REAPER_ENABLED")
    if cronjobs:
        check(in_process == "false", "a reaper CronJob and the in-process reaper both run")
        for cronjob in cronjobs:
            check(cronjob["spec"].get("concurrencyPolicy") == "Forbid", f"{name(cronjob)} may overlap runs")
            c = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
            check(c.get("args") == ["reap", "--once"], f"{name(cronjob)} runs {c.get('args')}, not reap --once")
    else:
        check(in_process == "true", "no reaper CronJob and the in-process reaper is off: nothing deletes expired records")


def check_rules(documents: list[dict[str, Any]], rules_out: Path | None, expect: Path | None) -> None:
    rules = of_kind(documents, "PrometheusRule")
    if not rules:
        check(expect is None, "no PrometheusRule rendered, though one was expected")
        return
    groups = rules[0]["spec"]["groups"]
    if rules_out:
        rules_out.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    if expect is not None:
        canonical = yaml.safe_load(expect.read_text())["groups"]
        if groups != canonical:
            fail(f"{name(rules[0])} with default values differs from {expect}")
            for g_rendered, g_file in zip(groups, canonical):
                for r_rendered, r_file in zip(g_rendered["rules"], g_file["rules"]):
                    if r_rendered != r_file:
                        print(f"       first difference in alert {r_file.get('alert')}:\n"
                              f"         chart: {json.dumps(r_rendered, sort_keys=True)}\n"
                              f"         file:  {json.dumps(r_file, sort_keys=True)}")
                        return


def check_dashboards(documents: list[dict[str, Any]], metrics: set[str]) -> None:
    for configmap in of_kind(documents, "ConfigMap"):
        if configmap["metadata"].get("labels", {}).get("grafana_dashboard") != "1":
            continue
        for key, text in (configmap.get("data") or {}).items():
            try:
                dashboard = json.loads(text)
            except json.JSONDecodeError as error:
                fail(f"{name(configmap)} {key} is not JSON: {error}")
                continue
            check_dashboard(dashboard, f"{name(configmap)} {key}", metrics)


def check_dashboard(dashboard: dict[str, Any], where: str, metrics: set[str]) -> None:
    panels = [p for p in dashboard.get("panels", []) if p.get("type") != "row"]
    check(len(panels) >= 8, f"{where}: only {len(panels)} panels")
    exprs = [t.get("expr", "") for p in panels for t in p.get("targets", [])]
    check(all(exprs) and len(exprs) >= len(panels), f"{where}: a panel has no query")
    missing = unknown_metrics(exprs, metrics)
    check(not missing, f"{where}: queries metrics the service does not export: {sorted(missing)}")
    ids = [p.get("id") for p in dashboard.get("panels", [])]
    check(len(ids) == len(set(ids)), f"{where}: duplicate panel ids")


# Grafana's own variables, as values PromQL accepts; the dashboard's template
# variables ($job) become a plain label value.
GRAFANA_INTERVALS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def write_dashboard_rules(dashboard: dict[str, Any], out: Path) -> int:
    """Every panel query as a recording rule, so that promtool parses them."""
    rules = []
    for panel in dashboard.get("panels", []):
        for n, target in enumerate(panel.get("targets", [])):
            expr = target.get("expr", "")
            for variable, value in GRAFANA_INTERVALS.items():
                expr = expr.replace(variable, value)
            expr = re.sub(r"\$\{?\w+\}?", "x", expr)
            rules.append({"record": f"dashboard:panel_{panel.get('id')}_{n}", "expr": expr})
    out.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    return len(rules)


def check_values_documented(path: Path) -> int:
    """Every key outside list items needs a comment line right above it."""
    keys = 0
    previous = ""
    list_indent: int | None = None  # inside a list value started at this indentation
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if not stripped:
            continue
        indent = len(line) - len(line.lstrip())
        if list_indent is not None and (indent > list_indent or (indent == list_indent and stripped.startswith("- "))):
            previous = stripped
            continue
        list_indent = None
        if stripped.startswith("- "):
            list_indent = indent
        elif not stripped.startswith("#") and re.match(r"^[A-Za-z0-9_.\-]+:", stripped):
            keys += 1
            check(previous.startswith("#"), f"{path}:{number}: value {stripped.split(':')[0]!r} has no comment above it")
        previous = stripped
    return keys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    m = commands.add_parser("manifests")
    m.add_argument("directory", type=Path)
    m.add_argument("--rules-out", type=Path)
    m.add_argument("--expect-rules", type=Path)
    c = commands.add_parser("catalogue")
    c.add_argument("alerts", type=Path)
    c.add_argument("dashboard", type=Path)
    r = commands.add_parser("dashboard-rules")
    r.add_argument("dashboard", type=Path)
    r.add_argument("out", type=Path)
    v = commands.add_parser("values-doc")
    v.add_argument("values", type=Path)
    args = parser.parse_args()

    if args.command == "dashboard-rules":
        count = write_dashboard_rules(json.loads(args.dashboard.read_text()), args.out)
        print(f"  {count} panel queries written to {args.out}")
        return 0 if count else 1

    if args.command == "values-doc":
        keys = check_values_documented(args.values)
        print(f"  {keys} values, {len(failures)} without a comment above")
        return 1 if failures or keys == 0 else 0

    if args.command == "manifests":
        documents = load(args.directory)
        check_manifests(documents, known_settings())
        check_hardening(documents)
        check_rules(documents, args.rules_out, args.expect_rules)
        check_dashboards(documents, known_metrics())
        print(f"  {len(documents)} manifests, {len(failures)} finding(s)")
    else:
        metrics = known_metrics()
        rules = yaml.safe_load(args.alerts.read_text())
        alert_exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
        missing = unknown_metrics(alert_exprs, metrics)
        check(not missing, f"{args.alerts}: alerts on metrics the service does not export: {sorted(missing)}")
        for group in rules["groups"]:
            for rule in group["rules"]:
                alert = rule.get("alert", "?")
                check(rule.get("labels", {}).get("severity") in ("critical", "warning", "info"),
                      f"{alert}: no severity label")
                notes = rule.get("annotations", {})
                check(bool(notes.get("summary")) and bool(notes.get("description")), f"{alert}: summary or description missing")
                check(notes.get("runbook_url", "").endswith("#" + alert.lower()), f"{alert}: runbook_url does not point at #{alert.lower()}")
        check_dashboard(json.loads(args.dashboard.read_text()), str(args.dashboard), metrics)
        print(f"  {len(alert_exprs)} alerts and the dashboard checked against {len(metrics)} metric names, {len(failures)} finding(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
