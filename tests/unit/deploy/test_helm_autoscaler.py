"""The chart's autoscaler (`autoscaler.enabled`): least-privilege RBAC, the engine workloads it
sizes, one controller at a time. Rendered offline like the rest of the chart
(test_helm_chart.py also validates these objects against Kubernetes' schemas)."""

from __future__ import annotations

import re
from typing import Any

import helm_python as helm
import pytest

from tests.unit.deploy.helm_chart import NAMESPACE, RELEASE, Rendered, preset, render

ON = {"autoscaler": {"enabled": True}}
NAME = f"{RELEASE}-pdplane-autoscaler"


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _args(r: Rendered) -> list[str]:
    pod = r.one("Deployment", NAME)["spec"]["template"]["spec"]
    return [str(a) for a in pod["containers"][0]["args"]]


@pytest.mark.parametrize("workload", ["Deployment", "StatefulSet"])
def test_the_role_grants_get_and_patch_of_the_two_workloads_scale_and_nothing_else(
    workload: str,
) -> None:
    r = Rendered(render(preset("gpu-xpyd"), ON, {"engineDefaults": {"workload": workload}}))
    role = r.one("Role", NAME)
    plural = f"{workload.lower()}s/scale"
    assert role["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": [plural],
            "resourceNames": [f"{RELEASE}-pdplane-prefill", f"{RELEASE}-pdplane-decode"],
            "verbs": ["get", "patch"],
        }
    ]
    assert not r.of("ClusterRole") and not r.of("ClusterRoleBinding")
    binding = r.one("RoleBinding", NAME)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": NAME,
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}]
    # ...and the flags name exactly the workloads the Role covers.
    args = _args(r)
    assert _flag(args, "--prefill-workload") == f"{workload.lower()}/{RELEASE}-pdplane-prefill"
    assert _flag(args, "--decode-workload") == f"{workload.lower()}/{RELEASE}-pdplane-decode"
    assert _flag(args, "--namespace") == NAMESPACE


def test_only_the_autoscaler_pod_holds_a_kubernetes_api_token() -> None:
    r = Rendered(render(preset("gpu-xpyd"), ON))
    for w in r.workloads():
        pod = w["spec"]["template"]["spec"]
        mounts = pod.get("automountServiceAccountToken")
        if w["metadata"]["name"] == NAME:
            assert mounts is True and pod["serviceAccountName"] == NAME
        else:
            assert mounts is False, w["metadata"]["name"]
            assert pod.get("serviceAccountName") != NAME


def test_the_sized_workloads_leave_replicas_to_the_controller() -> None:
    # An upgrade must not reset the controller's counts: the chart renders no replicas there.
    on = Rendered(render(preset("gpu-xpyd"), ON))
    off = Rendered(render(preset("gpu-xpyd")))
    for group in ("prefill", "decode"):
        name = f"{RELEASE}-pdplane-{group}"
        assert "replicas" not in on.one("Deployment", name)["spec"]
        assert off.one("Deployment", name)["spec"]["replicas"] >= 1
    assert not off.names("Role") and NAME not in off.names("Deployment")


def test_several_replicas_elect_a_leader_on_the_registry_s_etcd() -> None:
    r = Rendered(render(preset("gpu-xpyd"), {"autoscaler": {"enabled": True, "replicas": 2}}))
    args = _args(r)
    registry = r.one("Deployment", f"{RELEASE}-pdplane-registry")
    reg_args = [str(a) for a in registry["spec"]["template"]["spec"]["containers"][0]["args"]]
    assert _flag(args, "--etcd-endpoints") == _flag(reg_args, "--etcd-endpoints")
    assert _flag(args, "--etcd-prefix") == _flag(reg_args, "--etcd-prefix")
    single = _args(Rendered(render(preset("cpu-demo"), ON)))
    assert "--etcd-endpoints" not in single


def test_the_spend_target_reaches_the_controller() -> None:
    values = {"autoscaler": {"enabled": True, "meanGpus": 4.5, "spendWindowS": 7200}}
    args = _args(Rendered(render(preset("cpu-demo"), values)))
    assert (_flag(args, "--mean-gpus"), _flag(args, "--spend-window-s")) == ("4.5", "7200")
    off = _args(Rendered(render(preset("cpu-demo"), ON)))
    assert _flag(off, "--mean-gpus") == "0"  # none by default


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"autoscaler": {"enabled": True, "replicas": 2}}, "needs registry.store=etcd"),
        ({"autoscaler": {"enabled": True, "decodeGroup": "nope"}}, '"nope" names no group'),
        (
            {"autoscaler": {"enabled": True, "prefillGroup": "decode"}},
            "prefillGroup must have role prefill",
        ),
        ({"autoscaler": {"enabled": True, "interval": 5}}, "additional properties"),
        ({"autoscaler": {"enabled": True, "meanGpus": -1}}, "meanGpus"),
        (
            {"autoscaler": {"enabled": True, "meanGpus": 1}},
            "autoscaler.meanGpus 1 is below the 2 GPUs",
        ),
        (
            {"autoscaler": {"enabled": True, "meanGpus": 17}},
            "autoscaler.meanGpus 17 is above the 16 GPUs",
        ),
        (
            {"autoscaler": {"enabled": True, "meanGpus": 5, "gpus": 4}},
            "autoscaler.meanGpus 5 is above the 4 GPUs",
        ),
        (
            {"autoscaler": {"enabled": True, "intervalS": 30, "windowS": 20}},
            "autoscaler.windowS must be at least autoscaler.intervalS",
        ),
    ],
)
def test_bad_autoscaler_values_fail_the_render(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(preset("cpu-demo"), values)
