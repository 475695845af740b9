"""The connector's reader of vLLM's KV events, against vLLM's real ZMQ publisher."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from pdplane.connector.kv_events import KvEventsReader, reader_endpoint
from pdplane.core.kv_events.log import KvEventLog
from tests.support.kv_replica import log_state

BS = 4
_SENTINEL = 987_654_321


def _stored(hashes: list[int], parent: int | None = None, **kw: object) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=[7] * (BS * len(hashes)),
        block_size=BS,
        lora_id=None,
        medium=kw.pop("medium", "GPU"),  # type: ignore[arg-type]
        lora_name=None,
        **kw,  # type: ignore[arg-type]
    )


def _wait(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def pair(tmp_path: Path):  # type: ignore[no-untyped-def]
    endpoint = f"ipc://{tmp_path}/kv-events.ipc"
    publisher = ZmqEventPublisher(0, endpoint=endpoint)
    reader = KvEventsReader(endpoint, KvEventLog())
    reader.start()
    # ZMQ drops what is published before the subscription is set up: publish until one lands
    deadline = time.monotonic() + 10
    while reader.batches == 0:
        assert time.monotonic() < deadline
        publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        time.sleep(0.05)
    # A probe may still be on its way (a late AllBlocksCleared would wipe a test's blocks):
    # ZMQ keeps order, so once a sentinel stored after the probes has landed and been removed
    # again, nothing of the warm-up is left in flight and the log holds no block.
    publisher.publish(KVEventBatch(ts=time.time(), events=[_stored([_SENTINEL])]))
    _wait(lambda: ("GPU", _SENTINEL) in log_state(reader.log))
    publisher.publish(
        KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=[_SENTINEL], medium="GPU")])
    )
    _wait(lambda: reader.log.num_blocks == 0)
    reader.gaps = 0  # the probes dropped before the subscription existed are gaps by design
    yield publisher, reader
    reader.stop()
    publisher.shutdown()


def test_events_reach_the_log_in_order(pair) -> None:  # type: ignore[no-untyped-def]
    publisher, reader = pair
    head = reader.log.head
    publisher.publish(KVEventBatch(ts=time.time(), events=[_stored([1, 2]), _stored([3], 2)]))
    publisher.publish(
        KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=[1], medium="GPU")])
    )
    _wait(lambda: reader.log.head == head + 3)
    state = log_state(reader.log)
    assert set(state) == {("GPU", 2), ("GPU", 3)}
    assert state[("GPU", 3)] == (2, (7, 7, 7, 7))
    assert reader.gaps == 0 and reader.rejected == 0


def test_extra_keys_media_and_bytes_hashes(pair) -> None:  # type: ignore[no-untyped-def]
    publisher, reader = pair
    head = reader.log.head
    h = b"\x00" * 24 + (42).to_bytes(8, "big")
    publisher.publish(
        KVEventBatch(ts=time.time(), events=[_stored([h], extra_keys=[("salt",)], medium="CPU")])
    )
    _wait(lambda: reader.log.head == head + 1)
    assert ("CPU", 42) in log_state(reader.log)
    _, blocks = reader.log.snapshot()
    assert [b.extra_key for m, k, b in blocks if k == 42] == ['["salt"]']


def test_malformed_store_is_counted_not_fatal(pair) -> None:  # type: ignore[no-untyped-def]
    publisher, reader = pair
    head = reader.log.head
    bad = BlockStored(
        block_hashes=[5, 6],
        parent_block_hash=None,
        token_ids=[1],
        block_size=BS,
        lora_id=None,
        medium=None,
        lora_name=None,
    )
    publisher.publish(KVEventBatch(ts=time.time(), events=[bad, _stored([9])]))
    _wait(lambda: reader.log.head == head + 1)
    assert reader.rejected == 1
    assert ("GPU", 9) in log_state(reader.log)


def test_a_lost_batch_clears_the_cached_set(pair) -> None:  # type: ignore[no-untyped-def]
    publisher, reader = pair
    publisher.publish(KVEventBatch(ts=time.time(), events=[_stored([1])]))
    _wait(lambda: reader.log.num_blocks == 1)
    assert reader._next_seq is not None
    reader._next_seq += 1  # as if one of the engine's batches had been lost on the way
    publisher.publish(KVEventBatch(ts=time.time(), events=[_stored([2])]))
    _wait(lambda: reader.gaps == 1 and ("GPU", 2) in log_state(reader.log))
    assert set(log_state(reader.log)) == {("GPU", 2)}  # never claims block 1 any more


def test_stop_closes_the_log(pair) -> None:  # type: ignore[no-untyped-def]
    _, reader = pair
    reader.stop()
    assert reader.log.closed


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("ipc:///run/x/kv.ipc", "ipc:///run/x/kv.ipc"),
        ("tcp://*:5557", "tcp://127.0.0.1:5557"),
        ("tcp://0.0.0.0:5557", "tcp://127.0.0.1:5557"),
        ("tcp://10.1.2.3:5557", None),
    ],
)
def test_reader_endpoint(endpoint: str, expected: str | None) -> None:
    cfg = SimpleNamespace(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
    assert reader_endpoint(cfg) == expected


def test_reader_endpoint_off() -> None:
    assert reader_endpoint(None) is None
    off = SimpleNamespace(enable_kv_cache_events=False, publisher="zmq", endpoint="ipc:///x")
    assert reader_endpoint(off) is None
    null = SimpleNamespace(enable_kv_cache_events=True, publisher="null", endpoint="ipc:///x")
    assert reader_endpoint(null) is None
    dp = SimpleNamespace(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:5557")
    assert reader_endpoint(dp, data_parallel_rank=2) == "tcp://127.0.0.1:5559"
