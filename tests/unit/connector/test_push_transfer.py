"""TCP push mode through real KvTransfer gRPC servers on loopback (no vLLM engine): prefill's
push session streams layers into decode's receive buffer; decode's puller takes them, or pulls
when the push was refused, broken or never came."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch

from pdplane.connector.holds import HoldTable
from pdplane.connector.kv_cache import KvCacheView
from pdplane.connector.metadata import LoadSpec
from pdplane.connector.peers import PeerPool
from pdplane.connector.pulls import Puller
from pdplane.connector.server import HoldAccess, KvServer, start_kv_server, worker_services
from pdplane.connector.transports.tcp import TcpTransport
from pdplane.v1 import instance_pb2

NUM_BLOCKS = 8
SHAPE = (NUM_BLOCKS, 2, 4, 16)  # CPU layout: block index first; 512 bytes per block
BLOCK_BYTES = 2 * 4 * 16 * 4


def _caches(fill: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        f"model.layers.{i}.self_attn.attn": (
            torch.randn(SHAPE, generator=gen) if fill else torch.zeros(SHAPE)
        )
        for i in range(2)
    }


@dataclass
class Node:
    transport: TcpTransport
    caches: dict[str, torch.Tensor]
    holds: HoldTable
    endpoint: str


@pytest.fixture
def layout() -> instance_pb2.KvLayout:
    return instance_pb2.KvLayout(
        num_layers=2, num_kv_heads=2, head_size=8, block_size=4, dtype="float32"
    )


@pytest.fixture
def start_node(layout: instance_pb2.KvLayout) -> Iterator[Callable[..., Node]]:
    servers: list[KvServer] = []

    def start(fill: bool, push_buffer_bytes: int = 0, push_ttl_s: float = 60.0) -> Node:
        caches = _caches(fill)
        transport = TcpTransport(
            chunk_bytes=700, push_buffer_bytes=push_buffer_bytes, push_ttl_s=push_ttl_s
        )
        transport.bind(KvCacheView(caches))
        holds = HoldTable()
        access = HoldAccess(holds, layout, arrival_wait_s=0.1)
        server = start_kv_server(worker_services(transport, access), "127.0.0.1:0")
        servers.append(server)
        return Node(transport, caches, holds, f"127.0.0.1:{server.port}")

    yield start
    for server in servers:
        server.stop(0)


@pytest.fixture
def peers() -> Iterator[PeerPool]:
    pool = PeerPool()
    yield pool
    pool.close()


def _wait(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _push(prefill: Node, decode: Node, peers: PeerPool, layout, items, layers=(0, 1)) -> None:
    session = prefill.transport.push_session(
        peers.get(decode.endpoint), "prefill-0", items, layout, time.monotonic() + 5
    )
    for layer in layers:
        session.send_layer(layer)
    session.finish()
    _wait(lambda: len(prefill.transport.push_results) >= len(items), "push results")


def test_pushed_layers_land_in_the_buffer_and_are_copied_into_decode_blocks(
    start_node, peers, layout
) -> None:
    prefill, decode = start_node(True), start_node(False, push_buffer_bytes=1 << 20)
    _push(prefill, decode, peers, layout, [("t1", [6, 3, 4])])
    (result,) = prefill.transport.push_results
    assert result.ok and result.nbytes == 2 * 3 * BLOCK_BYTES
    buffer = decode.transport.receive_buffer
    assert buffer is not None
    got = buffer.take(
        "t1", [5, 1], time.monotonic() + 1, sender_id="prefill-0", remote_block_indices=[0, 2]
    )
    assert got == 2 * 2 * BLOCK_BYTES
    for name, dst in decode.caches.items():
        src = prefill.caches[name]
        assert torch.equal(dst[5], src[6]) and torch.equal(dst[1], src[4])
        assert not dst[[b for b in range(NUM_BLOCKS) if b not in (1, 5)]].any()
    assert decode.transport.push_buffer is not None
    assert decode.transport.push_buffer.used_bytes == 0  # freed once taken


def test_a_full_buffer_answers_resource_exhausted_and_keeps_nothing(
    start_node, peers, layout
) -> None:
    prefill = start_node(True)
    decode = start_node(False, push_buffer_bytes=2 * 2 * BLOCK_BYTES)  # room for 2 blocks
    _push(prefill, decode, peers, layout, [("t1", [6, 3, 4])])
    (result,) = prefill.transport.push_results
    assert not result.ok and result.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert decode.transport.push_buffer is not None
    assert decode.transport.push_buffer.used_bytes == 0


def test_push_mode_off_on_decode_refuses_pushes(start_node, peers, layout) -> None:
    prefill, decode = start_node(True), start_node(False)  # no receive buffer
    _push(prefill, decode, peers, layout, [("t1", [6])])
    (result,) = prefill.transport.push_results
    assert result.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_push_with_another_layout_is_refused(start_node, peers, layout) -> None:
    prefill, decode = start_node(True), start_node(False, push_buffer_bytes=1 << 20)
    other = instance_pb2.KvLayout()
    other.CopyFrom(layout)
    other.block_size = 8
    _push(prefill, decode, peers, other, [("t1", [6])])
    (result,) = prefill.transport.push_results
    assert result.code == grpc.StatusCode.INVALID_ARGUMENT and "layout" in result.error


def test_an_aborted_push_frees_its_room_on_decode(start_node, peers, layout) -> None:
    prefill, decode = start_node(True), start_node(False, push_buffer_bytes=1 << 20)
    buf = decode.transport.push_buffer
    assert buf is not None
    session = prefill.transport.push_session(
        peers.get(decode.endpoint), "prefill-0", [("t1", [6, 3])], layout, time.monotonic() + 5
    )
    _wait(lambda: buf.used_bytes > 0, "the reservation")
    session.send_layer(0)
    session.abort("test")
    _wait(lambda: buf.used_bytes == 0, "the partial push to be freed")
    assert buf.claim("t1", "prefill-0", wait_s=0) is None


def test_a_push_the_engine_never_finishes_ends_at_its_deadline(start_node, peers, layout) -> None:
    prefill, decode = start_node(True), start_node(False, push_buffer_bytes=1 << 20)
    buf = decode.transport.push_buffer
    assert buf is not None
    session = prefill.transport.push_session(
        peers.get(decode.endpoint), "prefill-0", [("t1", [6])], layout, time.monotonic() + 0.5
    )
    session.send_layer(0)  # layer 1 and finish() never come
    _wait(lambda: len(prefill.transport.push_results) == 1, "the stream to end", timeout=3.0)
    assert not prefill.transport.push_results[0].ok
    _wait(lambda: buf.used_bytes == 0 and len(buf) == 0, "the partial push to be freed")


def test_an_unclaimed_push_is_freed_by_the_per_step_expiry(start_node, peers, layout) -> None:
    prefill = start_node(True)
    decode = start_node(False, push_buffer_bytes=1 << 20, push_ttl_s=0.2)
    buf = decode.transport.push_buffer
    assert buf is not None
    _push(prefill, decode, peers, layout, [("t1", [6])])
    assert buf.used_bytes > 0
    buf.expire()
    assert buf.used_bytes > 0  # not due yet
    time.sleep(0.25)  # past the TTL (no other push arrives to trigger it)
    buf.expire()
    assert buf.used_bytes == 0 and len(buf) == 0


def _puller(decode: Node, peers: PeerPool, layout, push_wait_s: float = 0.2) -> Puller:
    return Puller(
        decode.transport, peers, layout, "decode-0", pull_timeout_s=5.0, push_wait_s=push_wait_s
    )


def _load(tid: str, endpoint: str, pushed: bool = True) -> LoadSpec:
    return LoadSpec(
        req_id=f"req-{tid}",
        transfer_id=tid,
        endpoint=endpoint,
        remote_block_indices=(0, 1),
        local_block_ids=(2, 7),
        num_tokens=8,
        pushed=pushed,
        sender_id="prefill-0",
    )


def _run(puller: Puller, spec: LoadSpec) -> set[str]:
    puller.submit(spec)
    done: set[str] = set()
    _wait(lambda: bool(done.update(puller.pop_finished()) or done), "the load")
    return done


def test_puller_takes_a_landed_push_and_completes_the_hold(start_node, peers, layout) -> None:
    prefill, decode = start_node(True), start_node(False, push_buffer_bytes=1 << 20)
    prefill.holds.add("req-p", "t1", [6, 3], 60)
    _push(prefill, decode, peers, layout, [("t1", [6, 3])])
    puller = _puller(decode, peers, layout)
    try:
        assert _run(puller, _load("t1", prefill.endpoint)) == {"req-t1"}
    finally:
        puller.close()
    (stats,) = puller.history
    assert stats.ok and stats.source == "push"
    assert puller.pop_load_errors() == set()
    for name, dst in decode.caches.items():
        assert torch.equal(dst[2], prefill.caches[name][6])
        assert torch.equal(dst[7], prefill.caches[name][3])
    _wait(lambda: prefill.holds.pop_finished() == {"req-p"}, "prefill's hold to end")


def test_puller_pulls_when_the_push_was_refused_and_refuses_a_late_one(
    start_node, peers, layout
) -> None:
    prefill = start_node(True)
    decode = start_node(False, push_buffer_bytes=BLOCK_BYTES)  # too small for any transfer
    prefill.holds.add("req-p", "t1", [6, 3], 60)
    _push(prefill, decode, peers, layout, [("t1", [6, 3])])
    # A long push wait, so that waiting it out and not waiting differ by far more than a busy
    # host's pauses.
    puller = _puller(decode, peers, layout, push_wait_s=3.0)
    try:
        _run(puller, _load("t1", prefill.endpoint))
    finally:
        puller.close()
    (stats,) = puller.history
    assert stats.ok and stats.source == "pull"
    assert stats.seconds < 1.5  # a refused push is not waited for (3 s)
    for name, dst in decode.caches.items():
        assert torch.equal(dst[2], prefill.caches[name][6])


def test_puller_waits_at_most_push_wait_then_pulls(start_node, peers, layout) -> None:
    prefill, decode = start_node(True), start_node(False, push_buffer_bytes=1 << 20)
    prefill.holds.add("req-p", "t1", [6, 3], 60)  # announced as pushed, never pushed
    puller = _puller(decode, peers, layout)
    try:
        _run(puller, _load("t1", prefill.endpoint))
    finally:
        puller.close()
    (stats,) = puller.history
    assert stats.ok and stats.source == "pull" and stats.seconds >= 0.2
    # a push arriving now is refused: decode already has the KV
    _push(prefill, decode, peers, layout, [("t1", [6, 3])])
    assert prefill.transport.push_results[-1].code == grpc.StatusCode.ALREADY_EXISTS
