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
idempotencyd reads (from server/src). The security checks: every file a
setting names (certificate, key, client CA, JWKS, tokens, policy, database
URL) lies in a volume mounted as a directory (no subPath, so rotations reach
the pod) whose Secret or ConfigMap the chart renders (then with that key) or
names; the settings pair up as the server wants; the policy's TOML and the
JWKS parse; the probes use the plain-text health port; no Service but
"<fullname>-metrics" carries the metrics port; the NetworkPolicy opens the
gRPC port only to selected peers and the metrics port only to namespaces;
a cert-manager Certificate covers the Services' names and feeds the mounted
Secret; the URL of the database is never an environment variable. With
--rules-out it writes the PrometheusRule's groups as a plain rules file (for
promtool); with --expect-rules it also requires them to equal that rules
file; with --expect-network-policy it requires a NetworkPolicy.

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
import tomllib
from pathlib import Path
from typing import Any, Iterator

import yaml

ROOT = Path(__file__).resolve().parents[2]
SERVER_SRC = ROOT / "server" / "src"
UID = 65532
HOOK_EVENTS = {"pre-install", "pre-upgrade"}
# Settings that name a file, and whether the file must come from a Secret.
FILE_SETTINGS = {
    "IDEMPOTENCY_TLS_CERT": True,
    "IDEMPOTENCY_TLS_KEY": True,
    "IDEMPOTENCY_TLS_CLIENT_CA": False,
    "IDEMPOTENCY_JWT_JWKS": False,
    "IDEMPOTENCY_STATIC_TOKENS": True,
    "IDEMPOTENCY_AUTH_POLICY": False,
    "DATABASE_URL_FILE": True,
}
CREDENTIAL_SETTINGS = ("IDEMPOTENCY_TLS_CLIENT_CA", "IDEMPOTENCY_JWT_JWKS", "IDEMPOTENCY_STATIC_TOKENS")
POLICY_ROLES = {"caller", "reader", "admin"}
# Keys cert-manager writes into a Certificate's Secret.
CERT_MANAGER_KEYS = {"tls.crt", "tls.key", "ca.crt"}

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
        # Files of mode 0440 (key, tokens, URL) are readable through the group only.
        for volume in spec.get("volumes") or []:
            source = volume.get("secret") or volume.get("configMap") or {}
            mode = source.get("defaultMode")
            if mode is not None and not mode & 0o004:
                check(pod.get("fsGroup") is not None,
                      f"{name(workload)}: volume {volume['name']} (mode {mode:o}) is unreadable without a pod fsGroup")


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


def volume_source(volume: dict[str, Any]) -> tuple[str, str] | None:
    """("Secret" | "ConfigMap", name) of a secret or configMap volume."""
    if "secret" in volume:
        return "Secret", volume["secret"].get("secretName", "")
    if "configMap" in volume:
        return "ConfigMap", volume["configMap"].get("name", "")
    return None


def volume_refs(spec: dict[str, Any], kind: str) -> list[str]:
    """Names of the Secrets or ConfigMaps a pod mounts (projected sources included)."""
    refs = []
    for volume in spec.get("volumes") or []:
        source = volume_source(volume)
        if source and source[0] == kind:
            refs.append(source[1])
        for projected in (volume.get("projected") or {}).get("sources") or []:
            key = "secret" if kind == "Secret" else "configMap"
            if key in projected:
                refs.append(projected[key]["name"])
    return refs


def container_settings(container: dict[str, Any], configmaps: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The variables a container gets from the chart's ConfigMaps and plain env values (env wins)."""
    values: dict[str, str] = {}
    for ref in container.get("envFrom") or []:
        if "configMapRef" in ref and ref["configMapRef"]["name"] in configmaps:
            values.update(configmaps[ref["configMapRef"]["name"]].get("data") or {})
    for env in container.get("env") or []:
        if "value" in env:
            values[env["name"]] = str(env["value"])
    return values


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
    check(set(ports) >= {"grpc", "metrics", "health"}, f"Deployment container ports {sorted(ports)} lack grpc/metrics/health")
    check(len(set(ports.values())) == len(ports), f"Deployment container ports share a number: {ports}")

    strategy = deployment["spec"].get("strategy") or {}
    check(strategy.get("type") == "RollingUpdate" and strategy.get("rollingUpdate", {}).get("maxUnavailable") == 0,
          "Deployment rollout may take serving pods away (maxUnavailable is not 0)")

    # The kubelet's gRPC probe speaks neither TLS nor a credential: every
    # probe must go to the plain-text health port, whatever the gRPC port wants.
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        target = (container.get(probe) or {}).get("grpc", {}).get("port")
        check(target is not None and target == ports.get("health"),
              f"{probe} is not the native gRPC probe on the health port {ports.get('health')} (targets {target!r})")

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
    check(settings_map.get("IDEMPOTENCY_HEALTH_ADDR", "").endswith(f":{ports.get('health')}"),
          "IDEMPOTENCY_HEALTH_ADDR does not listen on the container's health port")
    # The server's defaults are loopback: other pods and the kubelet reach only what is set explicitly.
    for setting in ("IDEMPOTENCY_GRPC_ADDR", "IDEMPOTENCY_METRICS_ADDR", "IDEMPOTENCY_HEALTH_ADDR"):
        address = settings_map.get(setting, "")
        check(bool(address) and not address.startswith(("127.", "localhost", "[::1]")),
              f"{setting} is {address!r}: set it, on an address other pods can reach")

    # Services, PDB, HPA, NetworkPolicy, ServiceMonitor point at the pods.
    services = of_kind(documents, "Service")
    for service in services:
        check(matches(service["spec"]["selector"], pod_labels), f"{name(service)} selects no server pod")
        for port in service["spec"]["ports"]:
            check(port.get("targetPort") in ports or port.get("targetPort") in ports.values(),
                  f"{name(service)} port {port['name']} targets {port.get('targetPort')!r}, not a container port")
    check(any(p["name"] == "grpc" and p.get("appProtocol") == "grpc" for s in services for p in s["spec"]["ports"]),
          "no Service port named grpc with appProtocol grpc")
    # /metrics (plain HTTP, no auth) only on "<fullname>-metrics", alone there;
    # the health port on no Service; the public Service carries gRPC only.
    def targets(port: dict[str, Any], container_port: str) -> bool:
        return port.get("targetPort") in (container_port, ports.get(container_port))
    for service in services:
        service_ports = service["spec"]["ports"]
        carries_metrics = any(targets(p, "metrics") for p in service_ports)
        is_metrics_service = service["metadata"]["name"].endswith("-metrics")
        check(not any(targets(p, "health") for p in service_ports), f"{name(service)} exposes the health port")
        if carries_metrics or is_metrics_service:
            check(is_metrics_service, f"{name(service)} exposes the metrics port; only <fullname>-metrics may")
            check(all(targets(p, "metrics") for p in service_ports), f"{name(service)} carries more than the metrics port")
            check(service["spec"].get("type", "ClusterIP") == "ClusterIP",
                  f"{name(service)} is of type {service['spec'].get('type')}, reachable from outside the cluster")
    public = by_name.get(f"Service/{deployment['metadata']['name']}")
    if check(public is not None, "no Service named like the Deployment (the one callers use)"):
        check([p["name"] for p in public["spec"]["ports"]] == ["grpc"],
              f"{name(public)} carries {[p['name'] for p in public['spec']['ports']]}, not the gRPC port alone")
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
        check(all(s["metadata"]["name"].endswith("-metrics") for s in selected),
              f"{name(monitor)} selects {[name(s) for s in selected]}, not the metrics Service alone")
        for endpoint in monitor["spec"]["endpoints"]:
            check(endpoint.get("port") in service_ports, f"{name(monitor)} scrapes port {endpoint.get('port')!r}, which no selected Service has")

    # Secrets and ConfigMaps every pod reads: created by the chart, or declared external.
    chart_secrets = {d["metadata"]["name"]: d for d in of_kind(documents, "Secret")}
    for workload, template in pod_specs(documents):
        for c in template["spec"]["containers"]:
            for ref in configmap_refs(c):
                check(ref in configmaps, f"{name(workload)} reads ConfigMap {ref}, which the chart does not create")
    # Everything the chart creates for the pods is read by one: a name that
    # differs between a template and its mount would otherwise pass as "external".
    read_configmaps = {ref for _, t in pod_specs(documents) for c in t["spec"]["containers"] for ref in configmap_refs(c)}
    read_configmaps |= {ref for _, t in pod_specs(documents) for ref in volume_refs(t["spec"], "ConfigMap")}
    read_secrets = {ref for _, t in pod_specs(documents) for c in t["spec"]["containers"] for ref in secret_refs(c)}
    read_secrets |= {ref for _, t in pod_specs(documents) for ref in volume_refs(t["spec"], "Secret")}
    for configmap in configmaps.values():
        if configmap["metadata"].get("labels", {}).get("grafana_dashboard") == "1":
            continue
        check(configmap["metadata"]["name"] in read_configmaps, f"{name(configmap)} is created but no pod reads it")
    for secret_name, secret in chart_secrets.items():
        check(secret_name in read_secrets, f"{name(secret)} is created but no pod reads it")
    for certificate in of_kind(documents, "Certificate"):
        check(certificate["spec"].get("secretName") in read_secrets,
              f"{name(certificate)} writes Secret {certificate['spec'].get('secretName')!r}, which no pod mounts")

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
        for ref in volume_refs(spec, "ConfigMap"):
            check(ref not in configmaps or bool(hook_events(configmaps[ref])),
                  f"{name(job)} mounts ConfigMap {ref}, which does not exist yet on install")
        for c in spec["containers"]:
            check(c.get("args") == ["migrate"], f"{name(job)} runs {c.get('args')}, not migrate")
            check(not configmap_refs(c), f"{name(job)} reads a ConfigMap, which does not exist yet on install")
            for ref in secret_refs(c) + volume_refs(spec, "Secret"):
                secret = chart_secrets.get(ref)
                if secret is None:
                    continue  # an existing Secret, created before the install
                check(HOOK_EVENTS <= hook_events(secret) and hook_weight(secret) < hook_weight(job),
                      f"{name(job)} reads Secret {ref}, which is not a hook created before it")
    for workload, template in pod_specs(documents):
        if hook_events(workload):
            continue
        for c in template["spec"]["containers"]:
            for ref in secret_refs(c) + volume_refs(template["spec"], "Secret"):
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


# --- security: files, settings, policy, network, certificates -------------------


def go_duration_seconds(text: str) -> float | None:
    """A Go duration (cert-manager's): 2160h, 1h30m, 90m0s."""
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"([0-9]+(?:\.[0-9]+)?)(ns|us|µs|ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * units[u] for n, u in parts)


def resolve_file(path: str, workload: dict[str, Any], spec: dict[str, Any], container: dict[str, Any],
                 documents: list[dict[str, Any]], setting: str, secret_only: bool) -> tuple[str, str, str, str | None] | None:
    """Follows a file path to (source kind, source name, key, data) through mount, volume and
    the rendered Secret or ConfigMap (data is None when the source is not rendered). Reports
    what does not fit."""
    where = f"{name(workload)} {setting}={path}"
    mounts = [m for m in container.get("volumeMounts") or [] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    if not check(bool(mounts), f"{where}: no volume is mounted above it"):
        return None
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    if not check("subPath" not in mount and "subPathExpr" not in mount,
                 f"{where}: mounted with subPath, so a renewed or edited file never reaches the pod"):
        return None
    check(mount.get("readOnly") is True, f"{where}: mount {mount['name']} is writable")
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    volume = volumes.get(mount["name"])
    if not check(volume is not None, f"{where}: volume {mount['name']} is mounted but not declared"):
        return None
    source = volume_source(volume)
    if not check(source is not None, f"{where}: volume {mount['name']} is neither a Secret nor a ConfigMap"):
        return None
    kind, source_name = source
    check(bool(source_name), f"{where}: volume {mount['name']} names no {kind}")
    check(not secret_only or kind == "Secret", f"{where}: comes from a {kind}, not a Secret")
    body = volume["secret"] if kind == "Secret" else volume["configMap"]
    check(body.get("optional") is not True, f"{where}: volume {mount['name']} is optional, so the file may silently be missing")
    relative = path[len(mount["mountPath"].rstrip("/")) + 1:]
    if body.get("items"):
        keys = [item["key"] for item in body["items"] if item.get("path") == relative]
        if not check(len(keys) == 1, f"{where}: no item of volume {mount['name']} maps a key to {relative}"):
            return None
        key = keys[0]
    else:
        key = relative
    rendered = next((d for d in of_kind(documents, kind) if d["metadata"]["name"] == source_name), None)
    if rendered is not None:
        data = {**(rendered.get("data") or {}), **(rendered.get("stringData") or {}), **(rendered.get("binaryData") or {})}
        if check(key in data, f"{where}: {name(rendered)} has no key {key!r}"):
            return kind, source_name, key, data[key]
        return None
    issued = [c for c in of_kind(documents, "Certificate") if c["spec"].get("secretName") == source_name]
    if kind == "Secret" and issued:
        check(key in CERT_MANAGER_KEYS, f"{where}: {name(issued[0])} writes {sorted(CERT_MANAGER_KEYS)} into {source_name}, not {key!r}")
    else:
        print(f"  note {where}: from {kind} {source_name} (key {key}), which the install expects to exist")
    return kind, source_name, key, None


def check_files(documents: list[dict[str, Any]], settings: set[str]) -> dict[str, tuple[str, str, str, str | None]]:
    """Every file setting of every container; returns the server's, resolved."""
    configmaps = {d["metadata"]["name"]: d for d in of_kind(documents, "ConfigMap")}
    server: dict[str, tuple[str, str, str, str | None]] = {}
    for workload, template in pod_specs(documents):
        spec = template["spec"]
        for container in spec["containers"]:
            values = container_settings(container, configmaps)
            where = f"{name(workload)} container {container['name']}"
            # The URL only as a file: never in the pod spec or the environment, and never both ways.
            for env in container.get("env") or []:
                check(env["name"] != "DATABASE_URL",
                      f"{where}: sets DATABASE_URL ({'a plain value' if 'value' in env else 'from a reference'}); use DATABASE_URL_FILE")
                if re.match(r"^(IDEMPOTENCY_|DATABASE_URL)", env["name"]):
                    check(env["name"] in settings, f"{where}: sets {env['name']}, which idempotencyd does not read (see server/src/settings.rs)")
            check(not any("secretRef" in e for e in container.get("envFrom") or []),
                  f"{where}: takes a whole Secret as environment variables")
            check("DATABASE_URL_FILE" in values, f"{where}: gets no DATABASE_URL_FILE")
            serves = (container.get("args") or ["serve"])[0] == "serve"
            for setting, secret_only in FILE_SETTINGS.items():
                # migrate and reap read only the URL; the shared ConfigMap's other files are the server's.
                if setting not in values or (not serves and setting != "DATABASE_URL_FILE"):
                    continue
                resolved = resolve_file(values[setting], workload, spec, container, documents, setting, secret_only)
                if resolved and workload["kind"] == "Deployment":
                    server[setting] = resolved
    return server


def check_security_settings(documents: list[dict[str, Any]], files: dict[str, tuple[str, str, str, str | None]]) -> None:
    """The server's settings pair up as it requires; the policy and the JWKS parse."""
    configmaps = {d["metadata"]["name"]: d for d in of_kind(documents, "ConfigMap")}
    deployment = of_kind(documents, "Deployment")[0]
    values = container_settings(deployment["spec"]["template"]["spec"]["containers"][0], configmaps)
    has = lambda setting: bool(values.get(setting))  # noqa: E731
    check(has("IDEMPOTENCY_TLS_CERT") == has("IDEMPOTENCY_TLS_KEY"), "IDEMPOTENCY_TLS_CERT and IDEMPOTENCY_TLS_KEY come only together")
    if "IDEMPOTENCY_TLS_CERT" in files and "IDEMPOTENCY_TLS_KEY" in files:
        check(files["IDEMPOTENCY_TLS_CERT"][:2] == files["IDEMPOTENCY_TLS_KEY"][:2],
              "the TLS certificate and key come from different Secrets: a rotation would pair a new one with an old one")
    check(not has("IDEMPOTENCY_TLS_CLIENT_CA") or has("IDEMPOTENCY_TLS_CERT"), "client certificates (IDEMPOTENCY_TLS_CLIENT_CA) without TLS")
    jwt = [has(s) for s in ("IDEMPOTENCY_JWT_JWKS", "IDEMPOTENCY_JWT_ISSUER", "IDEMPOTENCY_JWT_AUDIENCE")]
    check(all(jwt) or not any(jwt), "IDEMPOTENCY_JWT_JWKS, _ISSUER and _AUDIENCE come only together")
    credentials = [s for s in CREDENTIAL_SETTINGS if has(s)]
    check(not credentials or has("IDEMPOTENCY_AUTH_POLICY"), f"{credentials} on without IDEMPOTENCY_AUTH_POLICY: the server refuses to start")
    check(credentials or not has("IDEMPOTENCY_AUTH_POLICY"), "IDEMPOTENCY_AUTH_POLICY set, but no credential method names a caller")

    policy = files.get("IDEMPOTENCY_AUTH_POLICY")
    if policy and policy[3] is not None:
        check_policy(policy[3], f"{policy[0]}/{policy[1]} {policy[2]}")
    jwks = files.get("IDEMPOTENCY_JWT_JWKS")
    if jwks and jwks[3] is not None:
        where = f"{jwks[0]}/{jwks[1]} {jwks[2]}"
        try:
            keys = json.loads(jwks[3]).get("keys")
        except (json.JSONDecodeError, AttributeError) as error:
            fail(f"{where} is not a JWKS: {error}")
        else:
            if check(isinstance(keys, list) and bool(keys), f"{where}: no \"keys\" list"):
                for n, key in enumerate(keys, 1):
                    check(isinstance(key, dict) and key.get("kty") in ("RSA", "EC", "OKP") and bool(key.get("kid")),
                          f"{where}: key {n} has no kid or no kty among RSA, EC, OKP")


def check_policy(text: str, where: str) -> None:
    try:
        policy = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        fail(f"{where} is not TOML: {error}")
        return
    check(set(policy) <= {"grant"}, f"{where}: unknown tables {sorted(set(policy) - {'grant'})}")
    grants = policy.get("grant")
    if not check(isinstance(grants, list) and bool(grants), f"{where}: no [[grant]]"):
        return
    for n, grant in enumerate(grants, 1):
        if not check(isinstance(grant, dict), f"{where}: grant {n} is not a table"):
            continue
        check(set(grant) <= {"principals", "namespaces", "role"},
              f"{where}: grant {n} has unknown keys {sorted(set(grant) - {'principals', 'namespaces', 'role'})}")
        for field in ("principals", "namespaces"):
            entries = grant.get(field)
            check(isinstance(entries, list) and bool(entries) and all(isinstance(e, str) and e for e in entries),
                  f"{where}: grant {n} needs a non-empty list of {field}")
        check(grant.get("role") in POLICY_ROLES, f"{where}: grant {n} has role {grant.get('role')!r}, not one of {sorted(POLICY_ROLES)}")


def admits(rule: dict[str, Any], port: int | None, port_name: str, protocol: str = "TCP") -> bool:
    """Does a NetworkPolicy rule let this port through (a rule without ports lets every port)?"""
    if not rule.get("ports"):
        return True
    return any(p.get("protocol", "TCP") == protocol and p.get("port") in (port, port_name, None) for p in rule["ports"])


def allows_everyone(peer: dict[str, Any]) -> bool:
    if not peer:
        return True
    if "ipBlock" in peer:
        return peer["ipBlock"].get("cidr") in ("0.0.0.0/0", "::/0")
    return peer.get("namespaceSelector") == {} and not peer.get("podSelector")


def selects_namespaces(peer: dict[str, Any]) -> bool:
    selector = peer.get("namespaceSelector")
    return bool(selector) and bool(selector.get("matchLabels") or selector.get("matchExpressions"))


def check_network_policy(documents: list[dict[str, Any]], expected: bool) -> None:
    policies = of_kind(documents, "NetworkPolicy")
    if not policies:
        check(not expected, "no NetworkPolicy rendered, though one is expected (networkPolicy.enabled is on by default)")
        return
    deployment = of_kind(documents, "Deployment")[0]
    ports = {p["name"]: p["containerPort"] for p in deployment["spec"]["template"]["spec"]["containers"][0].get("ports") or []}
    for policy in policies:
        spec = policy["spec"]
        check(set(spec.get("policyTypes") or []) == {"Ingress", "Egress"}, f"{name(policy)} does not restrict both directions")
        ingress = spec.get("ingress") or []
        grpc_rules = [r for r in ingress if admits(r, ports.get("grpc"), "grpc")]
        if check(bool(grpc_rules), f"{name(policy)} lets no caller reach the gRPC port"):
            for rule in grpc_rules:
                peers = rule.get("from") or []
                check(bool(peers) and not any(allows_everyone(p) for p in peers),
                      f"{name(policy)} opens the gRPC port to every source: {peers or 'no from'}")
            check(any(selects_namespaces(p) for r in grpc_rules for p in r.get("from") or []),
                  f"{name(policy)} selects no calling namespaces for the gRPC port")
        for rule in ingress:
            if admits(rule, ports.get("metrics"), "metrics"):
                peers = rule.get("from") or []
                check(bool(peers) and all(selects_namespaces(p) for p in peers),
                      f"{name(policy)} opens the metrics port to more than selected namespaces: {peers or 'no from'}")
        check(any(admits(r, ports.get("health"), "health") for r in ingress),
              f"{name(policy)} keeps the kubelet's probes from the health port on CNIs that enforce it for node traffic")
        egress = spec.get("egress") or []
        check(any(admits(r, 53, "dns", "UDP") for r in egress), f"{name(policy)} blocks DNS")
        check(any(any(p.get("port") not in (53, None) and p.get("protocol", "TCP") == "TCP" for p in r.get("ports") or [])
                  for r in egress), f"{name(policy)} allows no egress to the database")


def check_certificates(documents: list[dict[str, Any]], files: dict[str, tuple[str, str, str, str | None]]) -> None:
    """cert-manager Certificates (no schema in kubernetes-validate): their essentials."""
    services = [s for s in of_kind(documents, "Service")
                if any(p["name"] == "grpc" for p in s["spec"]["ports"])]
    for certificate in of_kind(documents, "Certificate"):
        spec = certificate.get("spec") or {}
        check(certificate.get("apiVersion") == "cert-manager.io/v1", f"{name(certificate)} is {certificate.get('apiVersion')}, not cert-manager.io/v1")
        issuer = spec.get("issuerRef") or {}
        check(bool(issuer.get("name")), f"{name(certificate)} has no issuerRef.name")
        check(issuer.get("group", "cert-manager.io") != "cert-manager.io" or issuer.get("kind", "Issuer") in ("Issuer", "ClusterIssuer"),
              f"{name(certificate)} issuerRef.kind {issuer.get('kind')!r} is not Issuer or ClusterIssuer")
        tls = files.get("IDEMPOTENCY_TLS_CERT")
        check(tls is not None and tls[:2] == ("Secret", spec.get("secretName")),
              f"{name(certificate)} writes Secret {spec.get('secretName')!r}, but the server's certificate comes from {tls[:2] if tls else 'nowhere'}")
        names = set(spec.get("dnsNames") or [])
        for service in services:
            wanted = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
            check(wanted in names, f"{name(certificate)} does not cover {wanted}, the name of {name(service)}")
        check("server auth" in (spec.get("usages") or ["server auth"]), f"{name(certificate)} is not for server auth")
        duration = go_duration_seconds(str(spec.get("duration", "2160h")))
        renew = go_duration_seconds(str(spec.get("renewBefore", "720h")))
        if check(duration is not None and renew is not None,
                 f"{name(certificate)}: duration {spec.get('duration')!r} or renewBefore {spec.get('renewBefore')!r} is not a Go duration"):
            check(0 < renew < duration, f"{name(certificate)}: renewBefore {spec.get('renewBefore')} is not within duration {spec.get('duration')}")
        check((spec.get("privateKey") or {}).get("rotationPolicy") == "Always",
              f"{name(certificate)} keeps the same private key across renewals (privateKey.rotationPolicy is not Always)")


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
    m.add_argument("--expect-network-policy", action="store_true")
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
        settings = known_settings()
        check_manifests(documents, settings)
        files = check_files(documents, settings)
        check_security_settings(documents, files)
        check_network_policy(documents, args.expect_network_policy)
        check_certificates(documents, files)
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
