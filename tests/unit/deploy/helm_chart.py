"""Renders deploy/helm/pdplane offline (helm-python-sdk: Helm's own Go SDK, no binary, no
cluster) and indexes the rendered objects for the chart tests.

    objects = render(preset("cpu-demo"), {"tls": {"enabled": True, ...}})
    rendered = Rendered(objects)
    rendered.one("Deployment", "pd-pdplane-gateway")
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

__all__ = [
    "CHART_DIR",
    "NAMESPACE",
    "PRESETS",
    "RELEASE",
    "Container",
    "Rendered",
    "lint",
    "merge",
    "preset",
    "render",
]

CHART_DIR = Path(__file__).resolve().parents[3] / "deploy" / "helm" / "pdplane"
PRESETS = sorted(p.stem for p in (CHART_DIR / "presets").glob("*.yaml"))
RELEASE = "pd"
NAMESPACE = "serving"

WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")


def preset(name: str) -> dict[str, Any]:
    """The values of presets/<name>.yaml."""
    values: dict[str, Any] = yaml.safe_load((CHART_DIR / "presets" / f"{name}.yaml").read_text())
    return values


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Helm's merge of values: maps recursively, anything else replaced."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def render(*values: dict[str, Any]) -> list[dict[str, Any]]:
    """`helm template` of the chart with `values` merged left to right: the Kubernetes objects
    (NOTES.txt and empty documents left out). Raises helm.HelmError when a template fails."""
    merged: dict[str, Any] = {}
    for v in values:
        merged = merge(merged, v)
    chart = helm.Chart.load(CHART_DIR)
    manifests = chart.render(merged, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects: list[dict[str, Any]] = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def lint(values: dict[str, Any]) -> list[dict[str, Any]]:
    """`helm lint --strict` findings with `values`: dicts with severity (1 info, 2 warning,
    3 error), path and error; the run's own errors come as severity 3."""
    report = helm.lint(CHART_DIR, values, strict=True, namespace=NAMESPACE)
    errors = [{"severity": 3, "path": "", "error": e} for e in report.get("errors") or []]
    return [*(report.get("messages") or []), *errors]


@dataclass(frozen=True)
class Container:
    """One container of a rendered workload, with its pod spec and pod labels."""

    workload: dict[str, Any]
    spec: dict[str, Any]  # the container
    init: bool

    @property
    def pod(self) -> dict[str, Any]:
        pod: dict[str, Any] = self.workload["spec"]["template"]["spec"]
        return pod

    @property
    def labels(self) -> dict[str, str]:
        labels: dict[str, str] = self.workload["spec"]["template"]["metadata"]["labels"]
        return labels

    @property
    def where(self) -> str:
        return f"{self.workload['kind']}/{self.workload['metadata']['name']}:{self.spec['name']}"

    def env(self) -> dict[str, dict[str, Any]]:
        """Env var name -> its EnvVar object."""
        return {e["name"]: e for e in self.spec.get("env") or []}

    def args(self) -> list[str]:
        return [str(a) for a in self.spec.get("args") or []]

    def port_numbers(self) -> dict[str, int]:
        """Named container ports -> numbers."""
        return {p["name"]: p["containerPort"] for p in self.spec.get("ports") or [] if "name" in p}

    def mounts(self) -> dict[str, dict[str, Any]]:
        """mountPath -> the pod volume mounted there."""
        volumes = {v["name"]: v for v in self.pod.get("volumes") or []}
        for claim in self.workload["spec"].get("volumeClaimTemplates") or []:
            volumes[claim["metadata"]["name"]] = {"persistentVolumeClaim": claim["spec"]}
        return {m["mountPath"]: volumes[m["name"]] for m in self.spec.get("volumeMounts") or []}


class Rendered:
    """The objects of one render, by kind and name."""

    def __init__(self, objects: list[dict[str, Any]]) -> None:
        self.objects = objects

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def names(self, kind: str) -> set[str]:
        return {o["metadata"]["name"] for o in self.of(kind)}

    def one(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.of(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
        return found[0]

    def workloads(self) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] in WORKLOADS]

    def containers(self) -> Iterator[Container]:
        for w in self.workloads():
            pod = w["spec"]["template"]["spec"]
            for c in pod.get("initContainers") or []:
                yield Container(w, c, init=True)
            for c in pod["containers"]:
                yield Container(w, c, init=False)

    def selected(self, selector: dict[str, str]) -> list[dict[str, Any]]:
        """Workloads whose pod labels carry every label of `selector`."""
        return [
            w
            for w in self.workloads()
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
