"""The NCCL engine's control plane on CPU: pairs over real gRPC servers on loopback, with the
CPU stand-ins for NCCL and CUDA (tests/unit/nccl/fabric.py).

What is real: the pair table (cap, eviction), the `NcclKvTransfer.Pair` streams and
`Preconnect`, the connector's hold access, the message plan and the byte copies. The fake
NCCL asserts that every send meets a receive of exactly its size, so a receive posted before
prefill's verdict and never matched, or a filler of the wrong size, fails the test.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import torch

from pdplane.connector.holds import HoldTable
from pdplane.connector.peers import PeerPool
from pdplane.connector.server import HoldAccess, KvServer, start_kv_server
from pdplane.connector.transports.base import ServiceBinding
from pdplane.connector.transports.nccl.blocks import BlockMover, layer_byte_view
from pdplane.connector.transports.nccl.engine import NcclEngine
from pdplane.connector.transports.nccl.errors import NcclTransferError
from pdplane.connector.transports.nccl.plan import Strategy
from pdplane.connector.transports.nccl.service import SERVICE_NAME, NcclKvTransferServicer
from pdplane.v1 import (
    instance_pb2,
    kv_transfer_nccl_pb2,
    kv_transfer_nccl_pb2_grpc,
    kv_transfer_pb2,
)
from tests.unit.nccl.fabric import Fabric, FakeComms, cpu_cuda  # noqa: F401 - a fixture

NUM_BLOCKS = 16
LAYOUT = instance_pb2.KvLayout(
    num_layers=2, num_kv_heads=2, head_size=8, block_size=4, dtype="bfloat16"
)


@dataclass
class Node:
    name: str
    engine: NcclEngine
    caches: list[torch.Tensor]
    holds: HoldTable
    server: KvServer
    peers: PeerPool

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def states(self) -> dict[str, str]:
        return self.engine.states()["active"]


@pytest.fixture
def fabric(cpu_cuda: list[int]) -> Fabric:  # noqa: F811 - the fixture imported above
    return Fabric()


@pytest.fixture
def start_node(fabric: Fabric) -> Iterator[Callable[..., Node]]:
    nodes: list[Node] = []

    def start(name: str, seed: int = 0, cap: int = 64, chunk_bytes: int = 1 << 20) -> Node:
        gen = torch.Generator().manual_seed(seed)
        shape = (2, NUM_BLOCKS, 4, 2, 8)  # FlashAttention layout, int16 stand-in for bf16
        caches = [
            torch.randint(-999, 999, shape, generator=gen, dtype=torch.int16) for _ in range(2)
        ]
        views = [layer_byte_view(t, 1) for t in caches]
        engine = NcclEngine(
            0,
            views,
            Strategy.GATHER,
            chunk_bytes,
            connect_timeout_s=5.0,
            max_pairs=cap,
            comms=FakeComms(fabric),
            mover=BlockMover(views, "cpu"),
        )
        engine.instance_id = name
        holds = HoldTable()
        engine.access = HoldAccess(holds, LAYOUT, arrival_wait_s=0.1)
        peers = PeerPool()
        servicer = NcclKvTransferServicer(engine, peers)
        binding = ServiceBinding(
            SERVICE_NAME,
            lambda s: kv_transfer_nccl_pb2_grpc.add_NcclKvTransferServicer_to_server(servicer, s),
            threads=cap + 8,
        )
        node = Node(name, engine, caches, holds, start_kv_server([binding], "127.0.0.1:0"), peers)
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        node.engine.close()
        node.server.stop(0)
        node.peers.close()


def _pull(
    decode: Node,
    prefill: Node,
    tid: str,
    src: list[int],
    dst: list[int],
    hold: bool = True,
    **kw: Any,
) -> Any:
    if hold:
        assert prefill.holds.add(f"req-{tid}", tid, src, 60)
    request = kv_transfer_pb2.PullBlocksRequest(
        transfer_id=tid,
        block_indices=list(range(len(dst))),
        expected_layout=LAYOUT,
        requester_id=decode.name,
    )
    return decode.engine.pull(
        prefill.name,
        decode.peers.get(prefill.endpoint),
        request,
        dst,
        time.monotonic() + 10,
        **kw,
    )


def _same(decode: Node, dst: list[int], prefill: Node, src: list[int]) -> bool:
    return all(
        torch.equal(d[:, dst], s[:, src])
        for d, s in zip(decode.caches, prefill.caches, strict=True)
    )


def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_pulls_share_one_pair_and_its_stream(start_node: Callable[..., Node]) -> None:
    prefill, decode = start_node("p0", seed=1), start_node("d0", seed=2, chunk_bytes=256)
    first = _pull(decode, prefill, "t0", [3, 9, 4], [1, 2, 15])
    assert first.connect_s > 0 and first.nbytes == 3 * 2 * 2 * 4 * 2 * 8 * 2
    assert _same(decode, [1, 2, 15], prefill, [3, 9, 4])
    for i in range(1, 4):
        t = _pull(decode, prefill, f"t{i}", [i, i + 5], [i + 8, i])
        assert t.connect_s == 0 and 0 < t.sent_s <= t.post_s <= t.total_s
        assert _same(decode, [i + 8, i], prefill, [i, i + 5])
    assert decode.states() == {"p0#0/pull": "ready"}
    assert prefill.states() == {"d0#0/pull": "ready"}
    assert decode.engine.pairs.counters["created"] == 1
    assert len(decode.peers.get(prefill.endpoint)._stubs) == 1  # one stub, built once
    # prefill records a pull once its sends completed, which may be just after decode returns
    _until(lambda: len(prefill.engine.serve_timings) == 4)


@pytest.mark.parametrize("grouped", [False, True], ids=["gather-early-post", "grouped"])
def test_a_refused_pull_keeps_the_pair(start_node: Callable[..., Node], grouped: bool) -> None:
    prefill, decode = start_node("p0", seed=1), start_node("d0", seed=2, chunk_bytes=256)
    extra = {"strategy": Strategy.GROUPED, "remote_ids": [4, 5]} if grouped else {}
    with pytest.raises(NcclTransferError) as err:
        _pull(decode, prefill, "never-held", [4, 5], [1, 2], hold=False, **extra)
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    # The receive posted before the verdict (gather) was matched by filler: nothing dangles.
    (pair,) = decode.engine.pairs.all()
    assert pair.comm.posted == [] and pair.usable
    assert decode.engine.states()["retired"] == {}
    ok = _pull(decode, prefill, "held", [4, 5], [1, 2], **extra)
    assert ok.connect_s == 0 and _same(decode, [1, 2], prefill, [4, 5])


def test_a_bad_index_is_refused_after_an_early_post(start_node: Callable[..., Node]) -> None:
    prefill, decode = start_node("p0", seed=1), start_node("d0", seed=2)
    prefill.holds.add("r", "t", [1, 2], 60)
    request = kv_transfer_pb2.PullBlocksRequest(
        transfer_id="t", block_indices=[0, 7], expected_layout=LAYOUT, requester_id="d0"
    )
    peer = decode.peers.get(prefill.endpoint)
    with pytest.raises(NcclTransferError) as err:
        decode.engine.pull("p0", peer, request, [3, 4], time.monotonic() + 10)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert decode.engine.pairs.all()[0].usable


def test_more_peers_than_the_cap_evicts_idle_pairs_and_fails_no_transfer(
    start_node: Callable[..., Node],
) -> None:
    prefills = [start_node(f"p{i}", seed=i) for i in range(4)]
    decode = start_node("d0", seed=9, cap=2)
    errors: list[BaseException] = []

    def work(k: int) -> None:
        p = prefills[k % len(prefills)]
        src, dst = [k % NUM_BLOCKS, (k + 3) % NUM_BLOCKS], [(k + 1) % NUM_BLOCKS]
        try:
            _pull(decode, p, f"t{k}", src[:1], dst)
        except BaseException as exc:  # every transfer must succeed
            errors.append(exc)

    with futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(work, range(24)))
    assert errors == []
    counters = decode.engine.pairs.counters
    assert counters["evicted"] >= 2 and counters["failed"] == 0
    _until(lambda: len(decode.engine.pairs) <= 2)  # back under the cap once idle
    # The prefills' sides closed with them, cleanly (stream ended, not broken).
    _until(lambda: sum(len(p.engine.pairs) for p in prefills) <= 2)
    assert all(p.engine.pairs.counters["failed"] == 0 for p in prefills)


def test_a_peer_gone_drops_its_pairs_on_both_sides(start_node: Callable[..., Node]) -> None:
    prefill, decode = start_node("p0", seed=1), start_node("d0", seed=2)
    _pull(decode, prefill, "t0", [1], [2])
    assert decode.engine.drop_peer("p0") == 1
    assert decode.states() == {} and decode.engine.pairs.counters["dropped"] == 1
    _until(lambda: prefill.states() == {})  # the stream broke: prefill aborted its side
    # A new pair comes up on the next pull.
    t = _pull(decode, prefill, "t1", [3], [4])
    assert t.connect_s > 0 and decode.states() == {"p0#0/pull": "ready"}


def test_a_dead_peer_breaks_the_stream_and_the_pair_goes(start_node: Callable[..., Node]) -> None:
    prefill, decode = start_node("p0", seed=1), start_node("d0", seed=2)
    _pull(decode, prefill, "t0", [1], [2])
    prefill.server.stop(0)  # the process "died": its streams end
    _until(lambda: decode.states() == {})
    assert decode.engine.pairs.counters["failed"] == 1


def test_a_new_prefill_asks_decodes_to_connect_first(start_node: Callable[..., Node]) -> None:
    decode, prefill = start_node("d0", seed=2), start_node("p0", seed=1)
    stub = kv_transfer_nccl_pb2_grpc.NcclKvTransferStub(prefill.peers.get(decode.endpoint).channel)
    request = kv_transfer_nccl_pb2.NcclPreconnectRequest(
        requester_id="p0", tp_rank=0, endpoint=prefill.endpoint
    )
    assert stub.Preconnect(request, timeout=10).connected is True
    assert stub.Preconnect(request, timeout=10).connected is False  # up already
    assert decode.states() == {"p0#0/pull": "ready"}
    assert prefill.states() == {"d0#0/pull": "ready"}
    t = _pull(decode, prefill, "t0", [1, 2], [3, 4])
    assert t.connect_s == 0  # the first request pays no handshake


def test_a_preconnected_pair_ran_the_first_pulls_copies_on_the_thread_that_serves_it(
    start_node: Callable[..., Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pre-connect returns once the side that serves the pair (here prefill) has run the copy
    path a 1-block pull takes (the batched slice copy) on the thread that then serves the
    pair's pulls: the first pull launches nothing there that was not launched before."""
    decode, prefill = start_node("d0", seed=2), start_node("p0", seed=1)
    ran: list[tuple[int, bool, int, bool, int]] = []
    real_copy = BlockMover._copy

    def copy(self: BlockMover, is_send: bool, staging: Any, ids: Any, index: Any, chunk: Any):  # type: ignore[no-untyped-def]
        ran.append((id(self), is_send, len(ids), index is None, threading.get_ident()))
        return real_copy(self, is_send, staging, ids, index, chunk)

    monkeypatch.setattr(BlockMover, "_copy", copy)
    stub = kv_transfer_nccl_pb2_grpc.NcclKvTransferStub(prefill.peers.get(decode.endpoint).channel)
    request = kv_transfer_nccl_pb2.NcclPreconnectRequest(
        requester_id="p0", tp_rank=0, endpoint=prefill.endpoint
    )
    assert stub.Preconnect(request, timeout=10).connected is True
    d, p = id(decode.engine.mover), id(prefill.engine.mover)
    assert [r[:4] for r in ran] == [(p, True, 1, True)]  # the serving side, batched
    warm_thread = ran[0][4]
    ran.clear()
    t = _pull(decode, prefill, "t0", [5], [9])
    assert t.connect_s == 0 and _same(decode, [9], prefill, [5])
    assert sorted(r[:4] for r in ran) == sorted([(d, False, 1, True), (p, True, 1, True)])
    assert [r[4] for r in ran if r[0] == p] == [warm_thread]


def test_a_pair_whose_warm_up_fails_is_not_left_half_open(
    start_node: Callable[..., Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The serving side's warm-up fails (e.g. a CUDA error): the caller's handshake fails
    with the reason instead of waiting for `ready`, neither side keeps the pair, and the next
    handshake (warm-up working again) opens it."""
    decode, prefill = start_node("d0", seed=2), start_node("p0", seed=1)
    real = BlockMover.warm_pair
    monkeypatch.setattr(
        BlockMover, "warm_pair", lambda *a: (_ for _ in ()).throw(RuntimeError("no device"))
    )
    started = time.monotonic()
    with pytest.raises(NcclTransferError, match="no device"):
        _pull(decode, prefill, "t0", [1], [2])
    assert time.monotonic() - started < 4  # not the 5 s connect timeout
    assert decode.states() == {}
    until = time.monotonic() + 5  # the server ends its side once the stream is broken
    while prefill.states() and time.monotonic() < until:
        time.sleep(0.01)
    assert prefill.states() == {}
    monkeypatch.setattr(BlockMover, "warm_pair", real)
    _pull(decode, prefill, "t1", [3], [4])
    assert _same(decode, [4], prefill, [3])


def test_preconnect_never_evicts(start_node: Callable[..., Node]) -> None:
    decode = start_node("d0", cap=1)
    prefills = [start_node(f"p{i}", seed=i) for i in range(2)]
    _pull(decode, prefills[0], "t0", [1], [2])
    stub = kv_transfer_nccl_pb2_grpc.NcclKvTransferStub(
        prefills[1].peers.get(decode.endpoint).channel
    )
    with pytest.raises(grpc.RpcError) as err:
        stub.Preconnect(
            kv_transfer_nccl_pb2.NcclPreconnectRequest(
                requester_id="p1", endpoint=prefills[1].endpoint
            ),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert decode.states() == {"p0#0/pull": "ready"}


def test_a_stream_without_a_hello_is_refused(start_node: Callable[..., Node]) -> None:
    node = start_node("p0")
    stub = kv_transfer_nccl_pb2_grpc.NcclKvTransferStub(node.peers.get(node.endpoint).channel)
    close = kv_transfer_nccl_pb2.NcclControl(close=kv_transfer_nccl_pb2.NcclClose(reason="x"))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Pair(iter([close]), timeout=5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_shutdown_ends_the_pairs_of_both_sides(start_node: Callable[..., Node]) -> None:
    prefill, decode = start_node("p0", seed=1), start_node("d0", seed=2)
    _pull(decode, prefill, "t0", [1], [2])
    done = threading.Event()
    threading.Thread(target=lambda: (decode.engine.close(), done.set()), daemon=True).start()
    assert done.wait(5)
    _until(lambda: prefill.states() == {})


class _GatedWarmUp:
    """Holds the serving side's pair warm-up (`BlockMover.warm_pair`) until `go` is set, then
    runs the real one: `entered` is set once a warm-up started."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered, self.go = threading.Event(), threading.Event()
        real = BlockMover.warm_pair

        def warm_pair(mover: BlockMover, comm: Any, chunk_bytes: int, deadline: float) -> None:
            self.entered.set()
            assert self.go.wait(10)
            real(mover, comm, chunk_bytes, deadline)

        monkeypatch.setattr(BlockMover, "warm_pair", warm_pair)


def _in_thread(fn: Callable[[], Any]) -> futures.Future[Any]:
    pool = futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(fn)
    finally:
        pool.shutdown(wait=False)


def test_a_pair_warming_up_is_in_use_and_never_evicted(
    start_node: Callable[..., Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill's table is full (cap 1) with a pair whose warm-up still runs: making room for
    another handshake passes it over (it is in use, as a pair serving a pull is) instead of
    asking its caller to close before `ready`; its first pull then uses that one pair."""
    prefill, decode = start_node("p0", seed=1, cap=1), start_node("d0", seed=2)
    gate = _GatedWarmUp(monkeypatch)
    pulled = _in_thread(lambda: _pull(decode, prefill, "t0", [1], [2]))
    assert gate.entered.wait(5)
    assert prefill.engine.pairs.make_room() is False  # nothing idle: the cap is passed
    gate.go.set()
    t = pulled.result(10)
    assert t.connect_s > 0 and _same(decode, [2], prefill, [1])
    assert decode.engine.pairs.counters["created"] == 1 and len(decode.engine.comms.made) == 1
    assert decode.states() == {"p0#0/pull": "ready"}
    assert prefill.engine.states()["retired"] == {}
