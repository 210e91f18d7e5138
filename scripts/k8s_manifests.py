#!/usr/bin/env python3
"""Offline checks of the Kubernetes manifests in deploy/k8s (run by scripts/validate-k8s.sh).

  k8s_manifests.py validate        render every kustomization, validate every object
  k8s_manifests.py gen-rules       rewrite deploy/k8s/base/prometheusrule.yaml from
                                   deploy/prometheus/alerts.yml
  k8s_manifests.py render DIR      print the rendered kustomization DIR (multi-document YAML)

Rendering: a small renderer of the kustomize features the manifests use (`resources` as files
or directories, `labels` with `pairs`, `patches` whose file is a `$patch: delete` of one object).
Anything else in a kustomization is refused, so the renderer cannot silently differ from
kustomize. When `kubectl` (with its built-in kustomize) or `kustomize` is installed, its
rendering is compared with ours (same set of kind/name).

Validation: core kinds against the Kubernetes OpenAPI schemas that the `kubernetes-validate`
package ships (strict: unknown fields are errors), for each version in K8S_VERSIONS; KEDA and
Prometheus Operator kinds against their CRD schemas vendored in deploy/k8s/schemas/ (JSON
Schema, with unknown fields refused as the API server's strict field validation does). Then
rules of the project: the PrometheusRule carries exactly the rule groups of alerts.yml, the
workers run with WORKER_MIGRATE=false beside a `worker migrate` Job, probes, security context,
grace period, Secret references and the tools mount.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
RULE_FILE = K8S / "base" / "prometheusrule.yaml"
SCHEMAS = K8S / "schemas"
KUSTOMIZATIONS = [K8S / "base", K8S / "overlays" / "hpa"]
# Oldest and newest Kubernetes minor versions the manifests are checked against.
K8S_VERSIONS = ["1.29.0", "1.37.0"]
# docs/operations.md, "Graceful shutdown": WORKER_SHUTDOWN_GRACE_SECS, then the relay's final round.
RELAY_FLUSH_SECS = 10

RULE_HEADER = """\
# GENERATED from deploy/prometheus/alerts.yml by `scripts/validate-k8s.sh --regenerate`; do not
# edit. scripts/test.sh fails if the rule groups here differ from alerts.yml.
"""


class Failure(Exception):
    pass


# ---- rendering ----------------------------------------------------------------------------------

SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "labels", "patches"}


def load_docs(path: Path) -> list[dict]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def render(directory: Path) -> list[dict]:
    kfile = directory / "kustomization.yaml"
    if not kfile.exists():
        raise Failure(f"{directory}: no kustomization.yaml")
    k = yaml.safe_load(kfile.read_text())
    unknown = set(k) - SUPPORTED_KEYS
    if unknown:
        raise Failure(f"{kfile}: keys {sorted(unknown)} are not supported by the offline renderer")
    objects: list[dict] = []
    for entry in k.get("resources", []):
        target = (directory / entry).resolve()
        if target.is_dir():
            objects.extend(render(target))
        elif target.is_file():
            for doc in load_docs(target):
                doc.setdefault("metadata", {})
                doc["metadata"]["_source"] = str(target.relative_to(ROOT))
                objects.append(doc)
        else:
            raise Failure(f"{kfile}: resource {entry!r} does not exist")
    for label in k.get("labels", []):
        if set(label) - {"pairs"}:
            raise Failure(f"{kfile}: only `labels: - pairs:` is supported")
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(label["pairs"])
    for patch in k.get("patches", []):
        if set(patch) != {"path"}:
            raise Failure(f"{kfile}: only `patches: - path:` with a $patch: delete file is supported")
        docs = load_docs(directory / patch["path"])
        if len(docs) != 1 or docs[0].get("$patch") != "delete":
            raise Failure(f"{kfile}: patch {patch['path']} is not a single `$patch: delete` object")
        d = docs[0]
        before = len(objects)
        objects = [o for o in objects if ident(o) != ident(d)]
        if len(objects) != before - 1:
            raise Failure(f"{kfile}: patch {patch['path']} matches no object ({ident(d)})")
    seen = set()
    for o in objects:
        if ident(o) in seen:
            raise Failure(f"{directory}: {ident(o)} defined twice")
        seen.add(ident(o))
    return objects


def ident(o: dict) -> tuple[str, str, str]:
    group = o.get("apiVersion", "").rsplit("/", 1)[0] if "/" in o.get("apiVersion", "") else ""
    return (group, o.get("kind", ""), o.get("metadata", {}).get("name", ""))


def strip_source(o: dict) -> dict:
    o = copy.deepcopy(o)
    o["metadata"].pop("_source", None)
    return o


def external_renderer() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def cross_check(directory: Path, ours: list[dict]) -> str:
    cmd = external_renderer()
    if cmd is None:
        return "no kustomize/kubectl installed: rendered by the offline renderer only"
    out = subprocess.run(cmd + [str(directory)], capture_output=True, text=True)
    if out.returncode != 0:
        raise Failure(f"{' '.join(cmd)} {directory}: {out.stderr.strip()}")
    theirs = [d for d in yaml.safe_load_all(out.stdout) if d]
    a = sorted(ident(o) for o in ours)
    b = sorted(ident(o) for o in theirs)
    if a != b:
        raise Failure(f"{directory}: offline renderer gives {a}, {' '.join(cmd)} gives {b}")
    for t in theirs:
        o = next(strip_source(o) for o in ours if ident(o) == ident(t))
        if o != t:
            raise Failure(f"{directory}: {ident(t)} renders differently with {' '.join(cmd)}")
    return f"same objects as `{' '.join(cmd)}`"


# ---- schema validation --------------------------------------------------------------------------


def strict(schema):
    """Refuses unknown fields in CRD schemas, like `kubectl apply --validate=strict`."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if (
            schema.get("type") == "object"
            and "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    return schema


def crd_schema(obj: dict) -> dict | None:
    api = obj.get("apiVersion", "")
    if "/" not in api:
        return None
    group, version = api.rsplit("/", 1)
    path = SCHEMAS / f"{group}_{version}_{obj.get('kind', '').lower()}.json"
    if not path.exists():
        return None
    schema = json.loads(path.read_text())
    schema.pop("$comment", None)
    schema = strict(schema)
    # The API server checks these for every object; the CRD schemas leave them open.
    schema["properties"]["apiVersion"] = {"const": api}
    schema["properties"]["kind"] = {"const": obj["kind"]}
    schema["properties"]["metadata"] = {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
            "namespace": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        },
        "additionalProperties": False,
    }
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata", "spec"})
    return schema


CRD_GROUPS = {"keda.sh", "monitoring.coreos.com"}


def validate_schema(obj: dict) -> list[str]:
    where = f"{obj['metadata'].get('_source')}: {obj.get('kind')}/{obj['metadata'].get('name')}"
    o = strip_source(obj)
    errors = []
    if ident(o)[0] in CRD_GROUPS:
        schema = crd_schema(o)
        if schema is None:
            return [f"{where}: no vendored schema for {o.get('apiVersion')} {o.get('kind')} in {SCHEMAS}"]
        v = jsonschema.Draft7Validator(schema)
        for e in sorted(v.iter_errors(o), key=lambda e: list(e.absolute_path)):
            path = "/".join(str(p) for p in e.absolute_path)
            errors.append(f"{where}: {path}: {e.message}")
        return errors
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = "/".join(str(p) for p in e.path)
            errors.append(f"{where} (Kubernetes {version}): {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            errors.append(f"{where} (Kubernetes {version}): no schema: {e}")
    return errors


# ---- project rules ------------------------------------------------------------------------------


def alerts_groups() -> list:
    return yaml.safe_load(ALERTS.read_text())["groups"]


def rule_object() -> dict:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "intent-worker", "labels": {"app.kubernetes.io/name": "intent-worker"}},
        "spec": {"groups": alerts_groups()},
    }


class _RuleDumper(yaml.SafeDumper):
    pass


def _str(dumper, value):
    # Multi-line expressions stay readable block scalars, as in alerts.yml.
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_RuleDumper.add_representer(str, _str)


def gen_rules() -> None:
    text = yaml.dump(rule_object(), Dumper=_RuleDumper, sort_keys=False, width=1000, allow_unicode=True)
    RULE_FILE.write_text(RULE_HEADER + text)
    print(f"wrote {RULE_FILE.relative_to(ROOT)} ({sum(len(g['rules']) for g in alerts_groups())} rules)")


def find(objects, kind, name=None):
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    return found


def env_map(container: dict) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


def project_rules(name: str, objects: list[dict]) -> list[str]:
    errs = []

    def need(cond, msg):
        if not cond:
            errs.append(f"{name}: {msg}")

    rules = find(objects, "PrometheusRule")
    need(len(rules) == 1, "exactly one PrometheusRule")
    if rules:
        need(
            rules[0]["spec"]["groups"] == alerts_groups(),
            "the PrometheusRule's groups differ from deploy/prometheus/alerts.yml "
            "(run scripts/validate-k8s.sh --regenerate)",
        )
    deps = find(objects, "Deployment", "intent-worker")
    need(len(deps) == 1, "a Deployment intent-worker")
    if not deps:
        return errs
    dep = deps[0]
    need("replicas" not in dep["spec"], "the Deployment leaves replicas to the autoscaler")
    pod = dep["spec"]["template"]["spec"]
    c = next((c for c in pod["containers"] if c["name"] == "worker"), None)
    need(c is not None, "a container named worker")
    if c is None:
        return errs
    env = env_map(c)
    need(env.get("WORKER_MIGRATE", {}).get("value") == "false", "workers run with WORKER_MIGRATE=false")
    for key in ("DATABASE_URL", "AMQP_URL", "WORKER_ADMIN_TOKEN", "WORKER_TENANT_TOKENS"):
        e = env.get(key)
        need(e is not None and "value" not in e and "secretKeyRef" in e.get("valueFrom", {}),
             f"{key} comes from a Secret reference, never a value")
    grace = int(env.get("WORKER_SHUTDOWN_GRACE_SECS", {}).get("value", "30"))
    need(pod.get("terminationGracePeriodSeconds", 30) > grace + RELAY_FLUSH_SECS,
         f"terminationGracePeriodSeconds > WORKER_SHUTDOWN_GRACE_SECS ({grace}) + relay flush ({RELAY_FLUSH_SECS})")
    metrics_port = next((p["containerPort"] for p in c.get("ports", []) if p.get("name") == "metrics"), None)
    need(env.get("METRICS_ADDR", {}).get("value") == f"0.0.0.0:{metrics_port}",
         "METRICS_ADDR listens on all interfaces at the metrics port")
    need(c.get("livenessProbe", {}).get("httpGet", {}).get("path") == "/livez", "liveness probe on /livez")
    need(c.get("readinessProbe", {}).get("httpGet", {}).get("path") == "/readyz", "readiness probe on /readyz")
    for probe in ("livenessProbe", "readinessProbe"):
        need(c.get(probe, {}).get("httpGet", {}).get("port") in ("metrics", metrics_port), f"{probe} on the metrics port")
    psc, csc = pod.get("securityContext", {}), c.get("securityContext", {})
    need(psc.get("runAsNonRoot") is True, "pod runAsNonRoot")
    need(csc.get("readOnlyRootFilesystem") is True, "readOnlyRootFilesystem")
    need(csc.get("allowPrivilegeEscalation") is False, "allowPrivilegeEscalation: false")
    need({"requests", "limits"} <= set(c.get("resources", {})), "resources requests and limits")
    tools = env.get("WORKER_TOOLS", {}).get("value", "")
    mount = next((m for m in c.get("volumeMounts", []) if tools.startswith(m["mountPath"].rstrip("/") + "/")), None)
    need(mount is not None, "WORKER_TOOLS lies in a mounted volume")
    if mount:
        vol = next((v for v in pod.get("volumes", []) if v["name"] == mount["name"]), {})
        cm = find(objects, "ConfigMap", vol.get("configMap", {}).get("name"))
        need(len(cm) == 1 and Path(tools).name in cm[0].get("data", {}),
             f"the tools ConfigMap carries {Path(tools).name}")
    jobs = find(objects, "Job")
    need(any((j["spec"]["template"]["spec"]["containers"][0].get("command") or [])[-1:] == ["migrate"]
             or (j["spec"]["template"]["spec"]["containers"][0].get("args") or [])[-1:] == ["migrate"]
             for j in jobs), "a Job running `worker migrate`")
    need(len(find(objects, "PodDisruptionBudget")) == 1, "a PodDisruptionBudget")
    need(len(find(objects, "ServiceMonitor")) == 1, "a ServiceMonitor")
    scalers = find(objects, "ScaledObject") + find(objects, "HorizontalPodAutoscaler")
    need(len(scalers) == 1, "exactly one autoscaler (ScaledObject or HorizontalPodAutoscaler)")
    for s in find(objects, "ScaledObject"):
        trig = s["spec"].get("triggers", [])
        need(any(t["type"] == "rabbitmq" and t["metadata"].get("queueName") == "intents" for t in trig),
             "the ScaledObject scales on the intents queue")
    selector = dep["spec"]["selector"]["matchLabels"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    need(all(labels.get(k) == v for k, v in selector.items()), "the Deployment selector matches its pods")
    for kind in ("Service", "PodDisruptionBudget"):
        for o in find(objects, kind):
            sel = o["spec"]["selector"]
            sel = sel.get("matchLabels", sel) if kind == "PodDisruptionBudget" else sel
            need(all(labels.get(k) == v for k, v in sel.items()), f"{kind} selects the worker pods")
    return errs


def validate() -> int:
    problems = []
    for d in KUSTOMIZATIONS:
        name = str(d.relative_to(ROOT))
        try:
            objects = render(d)
            note = cross_check(d, objects)
        except Failure as e:
            problems.append(str(e))
            continue
        for o in objects:
            problems.extend(validate_schema(o))
        problems.extend(project_rules(name, objects))
        kinds = ", ".join(sorted(f"{o['kind']}/{o['metadata']['name']}" for o in objects))
        print(f"{name}: {len(objects)} objects ({note}): {kinds}")
    if problems:
        print(f"\n{len(problems)} problem(s):", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 1
    print(f"ok: valid for Kubernetes {' and '.join(K8S_VERSIONS)} (strict), KEDA and Prometheus "
          "Operator CRD schemas; PrometheusRule matches alerts.yml")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["validate"]:
        return validate()
    if argv[:1] == ["gen-rules"]:
        gen_rules()
        return 0
    if len(argv) == 2 and argv[0] == "render":
        docs = [strip_source(o) for o in render(Path(argv[1]).resolve())]
        yaml.safe_dump_all(docs, sys.stdout, sort_keys=False)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Failure as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
