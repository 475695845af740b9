"""The Kubernetes actuator, through the real `kubernetes` client, against an API server on
loopback that authorizes every request with the Role the chart renders for the autoscaler: the
actuator's moves work within that Role, use all of it, and anything more is refused.

The fake API serves the two endpoints the Role names (`apps/v1` `deployments/{name}/scale`,
GET and PATCH), keeps `spec.replicas` per workload and answers 403 with a Kubernetes `Status`
for any request the Role's rules do not allow (verb, resource/subresource, name).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdplane.autoscale.kubernetes import KubernetesActuator, Workload, apps_api
from pdplane.launch.ports import free_port_run
from pdplane.v1 import instance_pb2
from tests.unit.deploy.helm_chart import NAMESPACE, RELEASE, Rendered, preset, render

PREFILL, DECODE = f"{RELEASE}-pdplane-prefill", f"{RELEASE}-pdplane-decode"


class FakeApi:
    """Scale subresources of Deployments, authorized by `rules` (a Role's)."""

    def __init__(self, rules: list[dict[str, Any]], replicas: dict[str, int]) -> None:
        self.rules = rules
        self.replicas = dict(replicas)
        self.calls: list[tuple[str, str, str]] = []  # (verb, resource, name), allowed ones
        self.refused: list[tuple[str, str, str]] = []
        self.app = FastAPI()
        path = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"
        self.app.get(path)(self.read)
        self.app.patch(path)(self.patch)

    def allowed(self, verb: str, resource: str, name: str) -> bool:
        return any(
            "apps" in r["apiGroups"]
            and resource in r["resources"]
            and verb in r["verbs"]
            and name in r.get("resourceNames", [name])
            for r in self.rules
        )

    def _check(self, verb: str, ns: str, name: str) -> JSONResponse | None:
        key = (verb, "deployments/scale", name)
        if ns != NAMESPACE or not self.allowed(*key):
            self.refused.append(key)
            return JSONResponse(
                {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 403,
                 "reason": "Forbidden", "message": f"{verb} {name} forbidden"},
                status_code=403,
            )  # fmt: skip
        self.calls.append(key)
        return None

    def _scale(self, ns: str, name: str) -> dict[str, Any]:
        n = self.replicas[name]
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"replicas": n},
            "status": {"replicas": n},
        }

    async def read(self, ns: str, name: str) -> Any:
        return self._check("get", ns, name) or self._scale(ns, name)

    async def patch(self, ns: str, name: str, request: Request) -> Any:
        refused = self._check("patch", ns, name)
        if refused is not None:
            return refused
        body = await request.json()
        self.replicas[name] = int(body["spec"]["replicas"])
        return self._scale(ns, name)


@pytest.fixture
def api() -> Iterator[tuple[FakeApi, str]]:
    role = Rendered(render(preset("cpu-demo"), {"autoscaler": {"enabled": True}})).one(
        "Role", f"{RELEASE}-pdplane-autoscaler"
    )
    fake = FakeApi(role["rules"], {PREFILL: 1, DECODE: 3, f"{RELEASE}-pdplane-gateway": 1})
    port = free_port_run(1)
    server = uvicorn.Server(
        uvicorn.Config(fake.app, host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "fake API did not start"
        time.sleep(0.05)
    try:
        yield fake, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def _instance(iid: str, role: int, state: int) -> instance_pb2.Instance:
    inst = instance_pb2.Instance(state=state)
    inst.spec.instance_id = iid
    inst.spec.role = role
    return inst


def test_moves_work_within_the_chart_s_role_and_need_all_of_it(
    api: tuple[FakeApi, str],
) -> None:
    fake, url = api
    actuator = KubernetesActuator(
        apps_api(url),
        {
            "prefill": Workload("Deployment", PREFILL, NAMESPACE),
            "decode": Workload("Deployment", DECODE, NAMESPACE),
        },
    )
    serving, draining = instance_pb2.INSTANCE_STATE_SERVING, instance_pb2.INSTANCE_STATE_DRAINING
    listed = [
        _instance("p-0", instance_pb2.ROLE_PREFILL, serving),
        *(_instance(f"d-{i}", instance_pb2.ROLE_DECODE, serving) for i in range(3)),
    ]
    actuator.refresh(listed)
    state = actuator.state()
    assert (state.count("prefill").ready, state.count("decode").ready) == (1, 3)

    actuator.start("prefill")  # 1P3D -> 2P2D: a move between roles
    actuator.drain("decode")
    assert fake.replicas[PREFILL] == 2 and fake.replicas[DECODE] == 2
    # The registry still lists the removed decode (its preStop drains it); the new prefill pod
    # has not registered yet.
    listed[3] = _instance("d-2", instance_pb2.ROLE_DECODE, draining)
    actuator.refresh(listed)
    state = actuator.state()
    assert state.count("prefill").starting == 1 and state.count("prefill").ready == 1
    assert state.count("decode").ready == 2 and state.count("decode").draining == 1

    used = {(verb, resource) for verb, resource, _ in fake.calls}
    granted = {(v, res) for r in fake.rules for v in r["verbs"] for res in r["resources"]}
    assert used == granted  # every permission the Role grants is needed
    assert {name for _, _, name in fake.calls} == {PREFILL, DECODE}
    assert fake.refused == []

    # Anything beyond the Role is refused: another workload's scale.
    other = apps_api(url)
    with pytest.raises(kubernetes.client.ApiException) as err:
        other.patch_namespaced_deployment_scale(
            f"{RELEASE}-pdplane-gateway", NAMESPACE, {"spec": {"replicas": 5}}
        )
    assert err.value.status == 403
    assert fake.replicas[f"{RELEASE}-pdplane-gateway"] == 1
