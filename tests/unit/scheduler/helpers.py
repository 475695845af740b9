"""What the kv_aware and prefix warming tests share: prompts, an index filled by hand, requests
with exact block hashes and a clock the test moves."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any

from pdplane.core.prefix_hash import block_hashes
from pdplane.scheduler.kv_index import KvState, PrefixIndex
from pdplane.scheduler.port import RequestFeatures
from pdplane.v1 import instance_pb2, kv_events_pb2

MakeInstance = Callable[..., instance_pb2.Instance]
BS = 16  # the conftest instances' block size
#: Engine block hashes, unique across a test run (the index keys its own hashes by them).
engine_hashes = itertools.count(1)


def tokens(seed: int, n: int) -> list[int]:
    """`n` token ids drawn from `seed`."""
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def hold(index: PrefixIndex, instance_id: str, prompt: list[int], *, live: bool = True) -> None:
    """`instance_id` caches the full blocks of `prompt` (as its BlockStored events would say)."""
    inst = index.add_instance(instance_id)
    n = len(prompt) // BS
    inst.stored(
        kv_events_pb2.BlockStored(
            block_hashes=[next(engine_hashes) for _ in range(n)],
            token_ids=prompt[: n * BS],
            block_size=BS,
        )
    )
    index.set_state(inst, KvState.LIVE if live else KvState.STALE)


def req(n: int, prompt: list[int], **kwargs: Any) -> RequestFeatures:
    """Request `r{n}` of model "tiny" with `prompt`'s exact block hashes."""
    return RequestFeatures(
        request_id=f"r{n}",
        model="tiny",
        prompt_tokens=len(prompt),
        prefix_hashes={BS: block_hashes(prompt, BS)},
        **kwargs,
    )


class Clock:
    """The in-flight tracker's clock (s), moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now
