"""The scheduler's port: one feature definition, its one protobuf conversion, both
implementations built by one factory and raising the same errors."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry

from pdplane.core.prefix_hash import HASH_VERSION
from pdplane.scheduler import (
    EMBEDDED,
    Outcome,
    PolicySettings,
    RequestFeatures,
    SchedulerUnavailable,
    open_scheduler,
)
from pdplane.scheduler.errors import InvalidRequest
from pdplane.scheduler.local import LocalScheduler
from pdplane.scheduler.remote import RemoteScheduler
from pdplane.scheduler.view import StaticSource
from pdplane.scheduler.wire import (
    decision_from_pb,
    decision_to_pb,
    features_from_pb,
    features_to_pb,
    outcome_from_pb,
    outcome_to_pb,
)
from pdplane.v1 import instance_pb2, scheduler_pb2
from tests.unit.scheduler.conftest import instance

FEATURES = RequestFeatures(
    request_id="r1",
    model="tiny",
    prompt_tokens=100,
    max_tokens=16,
    routing_key="user-7",
    prefix_block_hashes=(1, 2**64 - 1),
    exclude_instance_ids=frozenset({"p9"}),
    prefill_policy="round_robin",
    decode_policy="random",
    prefix_hashes={16: (5, 2**64 - 1, 7), 64: (9,)},
    first_token_from_prefill=True,
)


class _Settings(PolicySettings):
    scheduler: str = EMBEDDED
    token: str | None = None
    tls_ca: str | None = None
    schedule_timeout_s: float = 5.0
    schedule_stream: bool = True
    release_batch_s: float = 0.05
    host: str = "127.0.0.1"
    inflight_port: int = 0


def test_every_feature_is_a_schedule_request_field_and_nothing_else() -> None:
    features = {f.name for f in dataclasses.fields(RequestFeatures)}
    wire = set(scheduler_pb2.ScheduleRequest.DESCRIPTOR.fields_by_name) - {"releases"}
    assert features == wire
    # No field is left at its default, so the round trip proves each is carried.
    defaults = RequestFeatures("", "", 0)
    assert all(getattr(FEATURES, f) != getattr(defaults, f) for f in features)


def test_features_and_decisions_survive_the_wire() -> None:
    back = features_from_pb(features_to_pb(FEATURES))
    # Repeated fields come back as the message's container and uint64 arrays (no copy into
    # Python ints): compared by value.
    as_tuples = {size: tuple(int(h) for h in hashes) for size, hashes in back.prefix_hashes.items()}
    assert dataclasses.replace(
        back, prefix_block_hashes=tuple(back.prefix_block_hashes), prefix_hashes=as_tuples
    ) == (FEATURES)
    assert features_to_pb(FEATURES).prefix_hashes[0].hash_version == HASH_VERSION
    ref = scheduler_pb2.InstanceRef(
        instance_id="d0", url="http://d0", kv_endpoint="d0:1", transport=instance_pb2.TRANSPORT_NCCL
    )
    response = scheduler_pb2.ScheduleResponse(prefill=ref, decode=ref, reason="why")
    assert decision_to_pb(decision_from_pb(response)) == response


def test_prefix_hashes_of_another_hash_version_are_dropped_and_a_repeated_size_refused() -> None:
    request = features_to_pb(FEATURES)
    request.prefix_hashes[1].hash_version = HASH_VERSION + 1
    kept = features_from_pb(request).prefix_hashes
    assert {size: [int(h) for h in hashes] for size, hashes in kept.items()} == {
        16: [5, 2**64 - 1, 7]
    }
    request.prefix_hashes.add(block_size=16, block_hashes=[1], hash_version=HASH_VERSION)
    with pytest.raises(InvalidRequest, match="block_size 16 given twice"):
        features_from_pb(request)


def test_outcomes_map_one_to_one_onto_the_proto_enum() -> None:
    numbers = {outcome_to_pb(o) for o in Outcome}
    assert numbers == set(scheduler_pb2.Outcome.values())
    assert all(outcome_from_pb(outcome_to_pb(o)) is o for o in Outcome)
    assert outcome_to_pb("cancelled") == scheduler_pb2.OUTCOME_CANCELLED  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outcome must be one of"):
        outcome_to_pb("done")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="outcome: unknown value 7"):
        outcome_from_pb(7)


async def test_local_port_decides_counts_and_raises_the_ports_errors() -> None:
    source = StaticSource(instance("p0", "prefill"), instance("d0", "decode"))
    port = open_scheduler(_Settings(), source=source, metrics_registry=CollectorRegistry())
    assert isinstance(port, LocalScheduler)
    decision = await port.schedule(RequestFeatures("r1", "tiny", 10))
    assert (decision.prefill.instance_id, decision.decode.instance_id) == ("p0", "d0")
    assert decision.reason.startswith("prefill kv_aware: cached=0/10 tokens")  # the default
    assert "(0 live)" in decision.reason
    assert await port.release("r1", Outcome.SUCCESS) is True
    assert await port.release("r1", Outcome.SUCCESS) is False
    with pytest.raises(SchedulerUnavailable, match="no prefill instance for model 'llama'"):
        await port.schedule(RequestFeatures("r2", "llama", 10))
    with pytest.raises(ValueError, match="prompt_tokens: must be > 0"):
        await port.schedule(RequestFeatures("r3", "tiny", 0))
    with pytest.raises(ValueError, match="outcome must be one of"):
        port.release_nowait("r1", "done")  # type: ignore[arg-type]
    await port.close()


def test_factory_builds_remote_for_an_address_and_refuses_embedded_without_instances() -> None:
    remote = open_scheduler(_Settings(scheduler="127.0.0.1:1"))
    assert isinstance(remote, RemoteScheduler)
    with pytest.raises(ValueError, match="needs the registry's instances"):
        open_scheduler(_Settings())
