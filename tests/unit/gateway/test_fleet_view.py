"""FleetView: /v1/models and /health from registry instances."""

from __future__ import annotations

from typing import Any

from pdplane.gateway.fleet_view import FleetView, build_view
from pdplane.v1 import instance_pb2

_LAYOUT = instance_pb2.KvLayout(num_layers=2, num_kv_heads=2, head_size=32, block_size=16,
                                dtype="float32")  # fmt: skip


def _inst(iid: str, role: int, model: str = "m", **spec: Any) -> instance_pb2.Instance:
    fields: dict[str, Any] = {
        "instance_id": iid,
        "role": role,
        "model": model,
        "kv_layout": _LAYOUT,
        "transport": instance_pb2.TRANSPORT_TCP,
        "max_model_len": 2048,
        **spec,
    }
    inst = instance_pb2.Instance(spec=instance_pb2.InstanceSpec(**fields))
    inst.state = instance_pb2.INSTANCE_STATE_SERVING
    inst.registered_at.seconds = 1000 + len(iid)
    return inst


def test_not_ready_and_empty_views_are_unhealthy() -> None:
    healthy, body = FleetView().health()
    assert not healthy and "registry not reachable" in body["reason"]
    healthy, body = build_view([]).health()
    assert not healthy and body["reason"] == "no instances registered"
    assert build_view([]).models_list() == {"object": "list", "data": []}


def test_one_decode_only_names_the_missing_prefill() -> None:
    view = build_view([_inst("d0", instance_pb2.ROLE_DECODE)])
    healthy, body = view.health()
    assert not healthy
    assert body["reason"] == "model 'm': no prefill instance"
    assert [m["id"] for m in view.models_list()["data"]] == ["m"]


def test_pair_is_healthy_and_models_are_deduplicated() -> None:
    view = build_view(
        [_inst("p0", instance_pb2.ROLE_PREFILL), _inst("d0", instance_pb2.ROLE_DECODE)]
    )
    healthy, body = view.health()
    assert healthy and body == {
        "status": "ok",
        "models": {"m": {"prefill": 1, "decode": 1, "paired": True}},
    }
    data = view.models_list()["data"]
    assert data == [{"id": "m", "object": "model", "created": 1002, "owned_by": "pdplane",
                     "root": "m", "parent": None, "max_model_len": 2048}]  # fmt: skip


def test_incompatible_or_draining_instances_do_not_make_a_pair() -> None:
    other = instance_pb2.KvLayout(num_layers=4, num_kv_heads=2, head_size=32, block_size=16,
                                  dtype="float32")  # fmt: skip
    view = build_view([_inst("p0", instance_pb2.ROLE_PREFILL, kv_layout=other),
                       _inst("d0", instance_pb2.ROLE_DECODE)])  # fmt: skip
    healthy, body = view.health()
    assert not healthy and "equal KV layout" in body["reason"]
    draining = _inst("p1", instance_pb2.ROLE_PREFILL)
    draining.state = instance_pb2.INSTANCE_STATE_DRAINING
    healthy, body = build_view([draining, _inst("d0", instance_pb2.ROLE_DECODE)]).health()
    assert not healthy and "no prefill instance" in body["reason"]


def test_one_model_without_a_pair_leaves_the_gateway_ready_for_the_others() -> None:
    # A readiness probe or load balancer reads /health: one model's trouble must not stop
    # traffic for a model that serves.
    view = build_view([_inst("p0", instance_pb2.ROLE_BOTH),
                       _inst("d1", instance_pb2.ROLE_DECODE, model="other")])  # fmt: skip
    ready, body = view.health()
    assert ready and body["status"] == "degraded"
    assert body["reason"] == "model 'other': no prefill instance"
    assert body["models"]["m"]["paired"] is True and body["models"]["other"]["paired"] is False


def test_no_servable_model_at_all_is_unavailable() -> None:
    view = build_view([_inst("d0", instance_pb2.ROLE_DECODE),
                       _inst("d1", instance_pb2.ROLE_DECODE, model="other")])  # fmt: skip
    ready, body = view.health()
    assert not ready and body["status"] == "unavailable"
    assert body["reason"] == "model 'm': no prefill instance; model 'other': no prefill instance"


def test_per_model_readiness_answers_for_that_model_alone() -> None:
    view = build_view([_inst("p0", instance_pb2.ROLE_BOTH),
                       _inst("d1", instance_pb2.ROLE_DECODE, model="other")])  # fmt: skip
    assert view.health("m") == (
        True,
        {
            "status": "ok",
            "model": "m",
            "models": {"m": {"prefill": 1, "decode": 1, "paired": True}},
        },
    )
    ready, body = view.health("other")
    assert not ready and body["status"] == "unavailable" and body["model"] == "other"
    assert body["reason"] == "model 'other': no prefill instance"
    assert list(body["models"]) == ["other"]
    ready, body = view.health("nope")
    assert not ready and body["reason"] == "model 'nope': no instance registered"
    assert body["models"] == {}
    ready, body = FleetView().health("m")
    assert not ready and "registry not reachable" in body["reason"]


def test_a_models_instances_changing_dates_it_and_nothing_else_does() -> None:
    p, d = _inst("p", instance_pb2.ROLE_PREFILL), _inst("d", instance_pb2.ROLE_DECODE)
    first = build_view([p, d])
    assert first.models["m"].changed_at == 0.0  # as the first snapshot found it
    d.load.num_running = 3  # a load report: the same processes
    same = build_view([p, d], first)
    assert same.models["m"].changed_at == 0.0
    gone = build_view([p], same)
    assert gone.models["m"].changed_at > 0.0 and gone.models["m"].decode == 0
    restarted = _inst("d", instance_pb2.ROLE_DECODE)
    restarted.registered_at.seconds += 60  # the same id registered again: a new process
    back = build_view([p, restarted], gone)
    assert back.models["m"].changed_at >= gone.models["m"].changed_at
    assert back.models["m"].registered_ns["d"] != first.models["m"].registered_ns["d"]
    assert build_view([p, restarted], back).models["m"].changed_at == back.models["m"].changed_at
