"""Builders for registry `Instance` messages and an in-memory instance source (a fake watcher)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import pytest

from pdplane.scheduler.candidate import Candidate
from pdplane.scheduler.view import Changes, StaticSource
from pdplane.v1 import instance_pb2
from tests.integration.registry.fixtures import make_spec
from tests.integration.scheduler.fixtures import ROLES


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
    layout = instance_pb2.KvLayout(
        num_layers=2, num_kv_heads=2, head_size=32, block_size=block_size, dtype=dtype
    )
    return instance_pb2.Instance(
        spec=make_spec(
            instance_id,
            ROLES[role],
            model,
            transport=transport,
            kv_layout=layout,
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


class FakeSource(StaticSource):
    """A StaticSource that counts how often the view re-read it: whole (`snapshots`) or by
    its change log (`log_reads`)."""

    def __init__(self, *instances: instance_pb2.Instance) -> None:
        super().__init__(*instances)
        self.snapshots = 0
        self.log_reads = 0

    def snapshot(self) -> dict[str, instance_pb2.Instance]:
        self.snapshots += 1
        return super().snapshot()

    def changes_since(self, cursor: Hashable | None) -> tuple[Hashable, Changes | None]:
        self.log_reads += 1
        return super().changes_since(cursor)


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
