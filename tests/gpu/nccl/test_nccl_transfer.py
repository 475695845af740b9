"""NCCL data path between two processes on one GPU: pull, push, dead peers.

Each process (tests/support/nccl_node.py) owns a paged KV cache in FlashAttention layout on the GPU,
the `nccl` transport and a KvTransfer gRPC server; bytes move over NCCL, control over gRPC.
Checksums are position-weighted sums per block over every layer, computed in each process.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from tests.gpu.nccl.helpers import (
    BLOCK_BYTES,
    NUM_BLOCKS,
    SMALL,
    block_sums,
    check_pull,
    ok,
    pull_blocks,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def test_pull_noncontiguous_blocks_arrive_byte_equal(start_node: Any) -> None:
    rng = random.Random(7)
    prefill = start_node("p0", seed=1, **SMALL)
    # 3 MiB chunks: a 10 MiB transfer takes several gather chunks, some splitting a layer.
    decode = start_node("d0", seed=2, chunk_bytes=3 << 20, **SMALL)
    for i in range(3):
        check_pull(decode, prefill, f"t{i}", rng)
    check_pull(decode, prefill, "run", rng, consecutive=True)
    comms = ok(decode.call("comms"))["comms"]
    assert comms["active"] == {"p0#0/pull": "ready"}  # one pair, kept for every transfer


def test_pull_errors_are_clean(start_node: Any) -> None:
    prefill = start_node("p0", seed=1, **SMALL)
    decode = start_node("d0", seed=2, **SMALL)
    answer = decode.call(
        "pull",
        endpoint=prefill.endpoint,
        peer_id="p0",
        transfer_id="never-held",
        block_indices=[0],
        local_ids=[1],
        timeout_s=10,
    )
    assert answer["ok"] is False and answer["code"] == "NOT_FOUND", answer
    # Decode posted the first receive before the verdict; prefill's filler matched it: the
    # communicator survives and is reused.
    comms = ok(decode.call("comms"))["comms"]
    assert comms == {"active": {"p0#0/pull": "ready"}, "retired": {}}
    # Out-of-range block index: refused the same way.
    bad = pull_blocks(decode, prefill, "held", [4, 5], [0, 99], [1, 2], timeout_s=10)
    assert bad["ok"] is False and bad["code"] == "INVALID_ARGUMENT", bad
    check_pull(decode, prefill, "after", random.Random(3))
    assert ok(decode.call("comms"))["comms"]["retired"] == {}


def test_push_spills_to_host_and_refuses_when_full(start_node: Any) -> None:
    rng = random.Random(11)
    item_bytes = 16 * BLOCK_BYTES  # 4 MiB
    prefill = start_node("p0", seed=1, **SMALL)
    decode = start_node(
        "d0",
        seed=2,
        push_gpu_bytes=item_bytes + item_bytes // 2,
        push_host_bytes=item_bytes + item_bytes // 2,
        **SMALL,
    )
    items = [
        {"transfer_id": f"push{i}", "block_ids": rng.sample(range(NUM_BLOCKS), 16)}
        for i in range(3)
    ]
    answer = ok(
        prefill.call("push", endpoint=decode.endpoint, peer_id="d0", items=items[:2], timeout_s=30)
    )
    assert answer["spilled"] == [False, True]  # GPU buffer first, then pinned host memory
    assert answer["bytes"] == 2 * item_bytes
    t0 = time.monotonic()
    full = prefill.call(
        "push", endpoint=decode.endpoint, peer_id="d0", items=items[2:], timeout_s=30
    )
    assert full["ok"] is False and full["code"] == "RESOURCE_EXHAUSTED", full
    assert time.monotonic() - t0 < 5  # refused at once, never waits for room
    for item in items[:2]:
        local = rng.sample(range(NUM_BLOCKS), 16)
        ok(decode.call("take", transfer_id=item["transfer_id"], local_ids=local, timeout_s=30))
        assert block_sums(decode, local) == block_sums(prefill, item["block_ids"])
    # Room is back: the refused transfer now goes through.
    ok(prefill.call("push", endpoint=decode.endpoint, peer_id="d0", items=items[2:], timeout_s=30))
    local = rng.sample(range(NUM_BLOCKS), 16)
    ok(decode.call("take", transfer_id="push2", local_ids=local, timeout_s=30))
    assert block_sums(decode, local) == block_sums(prefill, items[2]["block_ids"])
    missing = decode.call("take", transfer_id="never-pushed", local_ids=[0], timeout_s=1)
    assert missing["ok"] is False and missing["code"] == "NOT_FOUND"


# 2 GiB per transfer (several hundred ms over NCCL's socket transport): long enough to kill
# a peer while it runs.
BIG = {"layers": 4, "num_blocks": 8500}
BIG_BLOCKS = 8192
TIMEOUT_S = 8.0
#: the survivor may spend this long past its timeout: two bounded waits of an abort
#: (communicator.ABORT_WAIT_S each) plus scheduling slack
ABORT_GRACE_S = 5.0


def _big_pull_async(decode: Any, prefill: Any, transfer_id: str) -> None:
    held = list(range(BIG_BLOCKS))
    ok(prefill.call("hold", transfer_id=transfer_id, block_ids=held))
    decode.send(
        "pull",
        endpoint=prefill.endpoint,
        peer_id=prefill.instance_id,
        transfer_id=transfer_id,
        block_indices=list(range(BIG_BLOCKS)),
        local_ids=list(range(BIG_BLOCKS)),
        timeout_s=TIMEOUT_S,
    )


def test_prefill_killed_mid_transfer_decode_fails_in_time_then_recovers(
    start_node: Any,
) -> None:
    prefill = start_node("p0", seed=1, **BIG)
    decode = start_node("d0", seed=2, **BIG)
    check_pull(decode, prefill, "warm", random.Random(1))
    _big_pull_async(decode, prefill, "big")
    # Mid-transfer: prefill accepted and sends, decode posted its receives.
    prefill.wait_event("send_started", timeout=30, transfer_id="big")
    decode.wait_event("recv_posted", timeout=30, transfer_id="big")
    t0 = time.monotonic()
    prefill.kill()
    answer = decode.answer(timeout=TIMEOUT_S + 30)
    waited = time.monotonic() - t0
    assert answer["ok"] is False, answer
    assert waited < TIMEOUT_S + ABORT_GRACE_S, (waited, answer)  # the wait is bounded
    comms = ok(decode.call("comms"))["comms"]
    key = "p0#0/pull"
    assert key not in comms["active"], (comms, answer)
    assert comms["retired"][key] == "failed", (comms, answer)
    # A new prefill instance afterwards works.
    prefill2 = start_node("p1", seed=3, **BIG)
    check_pull(decode, prefill2, "after", random.Random(2))


def test_decode_killed_mid_transfer_prefill_aborts_then_serves_new_peer(
    start_node: Any,
) -> None:
    prefill = start_node("p0", seed=1, **BIG)
    decode = start_node("d0", seed=2, **BIG)
    check_pull(decode, prefill, "warm", random.Random(1))
    _big_pull_async(decode, prefill, "big")
    prefill.wait_event("send_started", timeout=30, transfer_id="big")
    decode.wait_event("recv_posted", timeout=30, transfer_id="big")
    t0 = time.monotonic()
    decode.kill()
    key = "d0#0/pull"
    while True:  # poll prefill until its pair with the dead decode is gone
        comms = ok(prefill.call("comms"))["comms"]
        if comms["retired"].get(key) == "failed":
            break
        if time.monotonic() - t0 > TIMEOUT_S + ABORT_GRACE_S:
            pytest.fail(f"prefill still holds {comms}; its log:\n{prefill.dump_stacks()}")
        time.sleep(0.05)
    assert key not in comms["active"]
    decode2 = start_node("d1", seed=4, **BIG)
    check_pull(decode2, prefill, "after", random.Random(2))
