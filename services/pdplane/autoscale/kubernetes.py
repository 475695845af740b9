"""The Kubernetes actuator: scales the Helm chart's prefill and decode workloads.

The controller changes `spec.replicas` through each workload's `scale` subresource
(`apps/v1` Deployments or StatefulSets), nothing else: the chart's Role grants `get` and
`patch` on `deployments/scale` (or `statefulsets/scale`) of exactly those workloads by name.

- start: replicas + 1. The new pod counts as starting until its instance is listed SERVING
  by the registry (vLLM loaded, connector registered): ready + starting = replicas.
- drain: replicas - 1. Kubernetes picks the pod (a not-ready one first, so an instance still
  starting goes first) and runs its preStop hook, which drains it in the registry and waits
  until it has no running or waiting request and no KV transfer (`files/drain_wait.py`), then
  stops it; meanwhile the registry lists it DRAINING, which counts as draining here.

Uses the `kubernetes` client (`pip install 'pdplane[kubernetes]'`; the chart's image has it),
in-cluster credentials by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdplane.autoscale.scrape import role_of
from pdplane.autoscale.state import ROLES, FleetState, RoleCount
from pdplane.v1 import instance_pb2

__all__ = ["KubernetesActuator", "Workload", "apps_api", "parse_workload"]


@dataclass(frozen=True, slots=True)
class Workload:
    """One scaled workload: kind (Deployment | StatefulSet) and name, in `namespace`."""

    kind: str
    name: str
    namespace: str


def parse_workload(text: str, namespace: str) -> Workload:
    """'deployment/NAME' or 'statefulset/NAME' -> Workload. Raises ValueError otherwise."""
    kind, _, name = text.partition("/")
    kinds = {"deployment": "Deployment", "statefulset": "StatefulSet"}
    if kind.lower() not in kinds or not name:
        raise ValueError(f"bad workload {text!r}: expected deployment/NAME or statefulset/NAME")
    return Workload(kinds[kind.lower()], name, namespace)


def apps_api(host: str | None = None) -> Any:
    """An `AppsV1Api` with in-cluster credentials, or talking to `host` (an API server URL:
    tests, `kubectl proxy`) without any. Raises ImportError naming the extra when the client
    is not installed, ValueError when there is no host and no in-cluster service account
    (run outside a pod)."""
    try:
        from kubernetes import client, config
    except ImportError as exc:  # optional dependency
        raise ImportError(
            "the Kubernetes actuator needs the kubernetes client: pip install 'pdplane[kubernetes]'"
        ) from exc
    if host is None:
        try:
            config.load_incluster_config()
        except config.ConfigException as exc:
            raise ValueError(
                f"no in-cluster Kubernetes credentials ({exc}): run it in a pod with a service "
                "account (the chart's autoscaler), or give --kube-api URL (e.g. kubectl proxy)"
            ) from exc
        return client.AppsV1Api()
    configuration = client.Configuration()
    configuration.host = host
    return client.AppsV1Api(client.ApiClient(configuration))


class KubernetesActuator:
    """Moves on one model's fleet through `api` (an `AppsV1Api`): `workloads` maps prefill
    and decode to their `Workload`."""

    def __init__(self, api: Any, workloads: dict[str, Workload]) -> None:
        missing = set(ROLES) - set(workloads)
        if missing:
            raise ValueError(f"no workload for {', '.join(sorted(missing))}")
        self.api = api
        self.workloads = workloads
        self.listed: list[instance_pb2.Instance] = []

    def _read(self, w: Workload) -> int:
        if w.kind == "StatefulSet":
            scale = self.api.read_namespaced_stateful_set_scale(w.name, w.namespace)
        else:
            scale = self.api.read_namespaced_deployment_scale(w.name, w.namespace)
        return int(scale.spec.replicas or 0)

    def _patch(self, w: Workload, replicas: int) -> None:
        body = {"spec": {"replicas": replicas}}
        if w.kind == "StatefulSet":
            self.api.patch_namespaced_stateful_set_scale(w.name, w.namespace, body)
        else:
            self.api.patch_namespaced_deployment_scale(w.name, w.namespace, body)

    def replicas(self, role: str) -> int:
        """The workload's `spec.replicas` now. Raises the client's ApiException on refusal."""
        return self._read(self.workloads[role])

    def refresh(self, instances: Sequence[instance_pb2.Instance]) -> None:
        self.listed = list(instances)

    def state(self) -> FleetState:
        """Ready: listed SERVING; draining: listed DRAINING; starting: the rest of replicas."""
        roles = {}
        for role in ROLES:
            mine = [i for i in self.listed if role_of(i) == role]
            ready = sum(1 for i in mine if i.state == instance_pb2.INSTANCE_STATE_SERVING)
            draining = sum(1 for i in mine if i.state == instance_pb2.INSTANCE_STATE_DRAINING)
            replicas = self.replicas(role)
            roles[role] = RoleCount(min(ready, replicas), max(0, replicas - ready), draining)
        return FleetState(roles)

    def start(self, role: str) -> None:
        w = self.workloads[role]
        self._patch(w, self._read(w) + 1)

    def drain(self, role: str) -> None:
        w = self.workloads[role]
        self._patch(w, max(1, self._read(w) - 1))
