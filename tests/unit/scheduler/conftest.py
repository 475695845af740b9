"""Builders for registry `Instance` messages and an in-memory instance source (a fake watcher)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pdplane.scheduler.candidate import Candidate
from pdplane.v1 import instance_pb2

ROLES = {
    "prefill": instance_pb2.ROLE_PREFILL,
    "decode": instance_pb2.ROLE_DECODE,
    "both": instance_pb2.ROLE_BOTH,
}


def instance(
    instance_id: str,
    role: str = "prefill",
    *,
    model: str = "tiny",
    draining: bool = False,
    block_size: int = 16,
    dtype: str = "float32",
    transport: int = instance_pb2.TRANSPORT_TCP,
    max_model_len: int = 2048,
    revision: int = 1,
    **load: Any,
) -> instance_pb2.Instance:
    """An Instance; `load` fields are LoadReport fields (num_running=, free_kv_blocks=, ...)."""
    return instance_pb2.Instance(
        spec=instance_pb2.InstanceSpec(
            instance_id=instance_id,
            role=ROLES[role],
            model=model,
            url=f"http://127.0.0.1/{instance_id}",
            kv_endpoint=f"127.0.0.1:1/{instance_id}",
            transport=transport,
            tp_size=1,
            kv_layout=instance_pb2.KvLayout(
                num_layers=2, num_kv_heads=2, head_size=32, block_size=block_size, dtype=dtype
            ),
            max_model_len=max_model_len,
        ),
        state=(
            instance_pb2.INSTANCE_STATE_DRAINING
            if draining
            else instance_pb2.INSTANCE_STATE_SERVING
        ),
        load=instance_pb2.LoadReport(**load),
        revision=revision,
    )


class FakeSource:
    """What `InstanceWatcher` offers the view: `revision` and `snapshot()`."""

    def __init__(self, *instances: instance_pb2.Instance) -> None:
        self.revision = 0
        self.snapshots = 0
        self._view: dict[str, instance_pb2.Instance] = {}
        self.put(*instances)

    def put(self, *instances: instance_pb2.Instance) -> None:
        for inst in instances:
            self.revision += 1
            self._view[inst.spec.instance_id] = inst

    def remove(self, instance_id: str) -> None:
        self.revision += 1
        del self._view[instance_id]

    def snapshot(self) -> dict[str, instance_pb2.Instance]:
        self.snapshots += 1
        return dict(self._view)


@pytest.fixture
def make_instance() -> Callable[..., instance_pb2.Instance]:
    return instance


@pytest.fixture
def make_candidate() -> Callable[..., Candidate]:
    def build(instance_id: str, role: str = "prefill", **kwargs: Any) -> Candidate:
        return Candidate.from_instance(instance(instance_id, role, **kwargs))

    return build


@pytest.fixture
def fake_source() -> type[FakeSource]:
    return FakeSource
