"""Helpers of the NCCL GPU tests: node calls, per-block checksums, a checked pull."""

from __future__ import annotations

import random
from typing import Any

NUM_BLOCKS = 256
LAYERS = 4
BLOCK_BYTES = LAYERS * 2 * 16 * 8 * 128 * 2  # K+V of 16 tokens, 8 heads x 128, bf16: 256 KiB
SMALL = {"layers": LAYERS, "num_blocks": NUM_BLOCKS}


def ok(answer: dict[str, Any]) -> dict[str, Any]:
    """`answer` (a node's reply), after checking it says ok."""
    assert answer.get("ok") is True, answer
    return answer


def block_sums(node: Any, ids: list[int]) -> list[int]:
    """`node`'s checksums of the KV blocks `ids`."""
    return ok(node.call("checksums", block_ids=ids))["checksums"]


def pull_blocks(
    decode: Any,
    prefill: Any,
    transfer_id: str,
    held: list[int],
    positions: list[int],
    local: list[int],
    timeout_s: float = 60.0,
    **extra: Any,
) -> dict[str, Any]:
    """Has `prefill` hold blocks `held` under `transfer_id`, then `decode` pull those at
    `positions` into its blocks `local`; returns decode's answer (not checked)."""
    ok(prefill.call("hold", transfer_id=transfer_id, block_ids=held))
    return decode.call(
        "pull",
        endpoint=prefill.endpoint,
        peer_id=prefill.instance_id,
        transfer_id=transfer_id,
        block_indices=positions,
        local_ids=local,
        timeout_s=timeout_s,
        **extra,
    )


def check_pull(
    decode: Any,
    prefill: Any,
    transfer_id: str,
    rng: random.Random,
    consecutive: bool = False,
) -> None:
    """Pulls 40 of 48 held blocks into random decode blocks; checksums must match."""
    if consecutive:
        start = rng.randrange(NUM_BLOCKS - 48)
        held = list(range(start, start + 48))
        positions = list(range(40))
        first = rng.randrange(NUM_BLOCKS - 40)
        local = list(range(first, first + 40))
    else:
        held = rng.sample(range(NUM_BLOCKS), 48)
        positions = sorted(rng.sample(range(48), 40))
        local = rng.sample(range(NUM_BLOCKS), 40)
    src = [held[p] for p in positions]
    before = block_sums(decode, local)
    answer = ok(pull_blocks(decode, prefill, transfer_id, held, positions, local))
    assert answer["bytes"] == 40 * BLOCK_BYTES
    expected = block_sums(prefill, src)
    assert before != expected  # the destination did not hold these bytes already
    assert block_sums(decode, local) == expected
