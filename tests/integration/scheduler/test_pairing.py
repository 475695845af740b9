"""Real registry + real scheduler on loopback: pairing per policy, unfit instances never chosen."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import grpc
import pytest

from pdplane.scheduler import RequestFeatures
from pdplane.scheduler.remote import RemoteScheduler
from pdplane.scheduler.server import SchedulerServer
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from tests.integration.registry.fixtures import make_spec
from tests.integration.scheduler.conftest import Fleet, sees, view_of, wait_for

POLICIES = ["round_robin", "random", "least_loaded", "power_of_two", "consistent_hash", "kv_aware"]
BF16 = instance_pb2.KvLayout(
    num_layers=2, num_kv_heads=2, head_size=32, block_size=16, dtype="bfloat16"
)


def _two_by_two_plus_misfits(fleet: Fleet) -> None:
    for name in ("p0", "p1"):
        fleet.add(name, "prefill")
    for name in ("d0", "d1"):
        fleet.add(name, "decode")
    fleet.add("d-layout", "decode", kv_layout=BF16)
    fleet.add("d-nccl", "decode", transport=instance_pb2.TRANSPORT_NCCL)
    fleet.add("p-short", "prefill", max_model_len=64)
    fleet.add("d-short", "decode", max_model_len=64)
    fleet.add("d-model", "decode", model="other")


@pytest.mark.parametrize("policy", POLICIES)
async def test_each_policy_pairs_compatible_instances(
    policy: str,
    fleet: Fleet,
    scheduler_factory: Callable[..., SchedulerServer],
    client_factory: Callable[..., RemoteScheduler],
) -> None:
    _two_by_two_plus_misfits(fleet)
    server = scheduler_factory(prefill_policy=policy, decode_policy=policy, seed=5)
    ids = ("p0", "p1", "d0", "d1", "d-layout", "d-nccl", "p-short", "d-short")
    wait_for(sees(server, *ids), what="the fleet in the scheduler's view")
    client = client_factory(server.address)
    pairs = []
    for i in range(40):
        # Distinct routing keys, so consistent_hash spreads too.
        response = await client.schedule(
            RequestFeatures(f"r{i}", "tiny", 100, 16, routing_key=f"user-{i}")
        )
        pairs.append((response.prefill.instance_id, response.decode.instance_id))
        assert response.prefill.url == fleet.specs[response.prefill.instance_id].url
        decode_spec = fleet.specs[response.decode.instance_id]
        assert response.decode.kv_endpoint == decode_spec.kv_endpoint
        assert response.decode.transport == instance_pb2.TRANSPORT_TCP
        assert response.reason.startswith(f"prefill {policy}: ")
        assert f"; decode {policy}: " in response.reason
    prefills, decodes = Counter(p for p, _ in pairs), Counter(d for _, d in pairs)
    assert set(prefills) == {"p0", "p1"}  # both used, no misfit ever
    assert set(decodes) == {"d0", "d1"}
    if policy == "round_robin":
        assert [p for p, _ in pairs[:4]] == ["p0", "p1", "p0", "p1"]
    if policy == "consistent_hash":
        again = await client.schedule(
            RequestFeatures("again", "tiny", 100, 16, routing_key="user-7")
        )
        assert (again.prefill.instance_id, again.decode.instance_id) == pairs[7]


async def test_draining_and_expired_instances_are_never_chosen(
    registry: str,
    fleet: Fleet,
    scheduler_factory: Callable[..., SchedulerServer],
    client_factory: Callable[..., RemoteScheduler],
) -> None:
    fleet.add("p0", "prefill")
    fleet.add("d-ok", "decode")
    draining = fleet.add("d-drain", "decode")
    server = scheduler_factory(decode_policy="round_robin")
    # An instance that registers and never heartbeats: its lease expires after 300 ms.
    with grpc.insecure_channel(registry) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        stub.Register(
            registry_pb2.RegisterRequest(
                spec=make_spec("d-silent", instance_pb2.ROLE_DECODE), lease_ttl_ms=300
            )
        )
        wait_for(sees(server, "p0", "d-ok", "d-drain", "d-silent"), what="all four instances")
        stub.Deregister(
            registry_pb2.DeregisterRequest(
                instance_id="d-drain", lease_id=draining.lease_id, drain=True
            )
        )
    wait_for(
        lambda: (
            not any(
                c.instance_id == "d-drain" and c.serving for c in view_of(server).candidates("tiny")
            )
        ),
        what="d-drain to be DRAINING in the view",
    )
    wait_for(sees(server, "p0", "d-ok", "d-drain"), what="d-silent's lease to expire")
    client = client_factory(server.address)
    decodes = {
        (await client.schedule(RequestFeatures(f"r{i}", "tiny", 10))).decode.instance_id
        for i in range(20)
    }
    assert decodes == {"d-ok"}
