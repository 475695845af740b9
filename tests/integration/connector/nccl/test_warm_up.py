"""The serving side's pair warm-up (`BlockMover.warm_pair` on the pair's server-side reader
thread, before `ready`; docs/nccl.md, "Pairs") against what can happen meanwhile: eviction, the
peer dropped, shutdown, a caller that does not wait for `ready`, a warm-up that fails. On the
CPU stand-ins, over real gRPC (see test_pairs.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from pdplane.connector.transports.nccl.blocks import BlockMover
from pdplane.connector.transports.nccl.engine import NcclEngine
from pdplane.connector.transports.nccl.errors import NcclTransferError
from pdplane.connector.transports.nccl.pairs import Pair, PairKey, Purpose
from pdplane.v1 import kv_transfer_nccl_pb2, kv_transfer_nccl_pb2_grpc, kv_transfer_pb2
from tests.integration.connector.nccl.nodes import LAYOUT, Node, pull, same, wait_until
from tests.unit.connector.nccl.fabric import Fabric, FakeComms

_Control = kv_transfer_nccl_pb2.NcclControl


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
    t = pull(decode, prefill, "t0", [5], [9])
    assert t.connect_s == 0 and same(decode, [9], prefill, [5])
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
        pull(decode, prefill, "t0", [1], [2])
    assert time.monotonic() - started < 4  # not the 5 s connect timeout
    assert decode.states() == {}
    until = time.monotonic() + 5  # the server ends its side once the stream is broken
    while prefill.states() and time.monotonic() < until:
        time.sleep(0.01)
    assert prefill.states() == {}
    monkeypatch.setattr(BlockMover, "warm_pair", real)
    pull(decode, prefill, "t1", [3], [4])
    assert same(decode, [4], prefill, [3])


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
    pulled = _in_thread(lambda: pull(decode, prefill, "t0", [1], [2]))
    assert gate.entered.wait(5)
    assert prefill.engine.pairs.make_room() is False  # nothing idle: the cap is passed
    gate.go.set()
    t = pulled.result(10)
    assert t.connect_s > 0 and same(decode, [2], prefill, [1])
    assert decode.engine.pairs.counters["created"] == 1 and len(decode.engine.comms.made) == 1
    assert decode.states() == {"p0#0/pull": "ready"}
    assert prefill.engine.states()["retired"] == {}


def _link_threads(key: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"nccl-link-{key}"]


@pytest.mark.parametrize("how", ["drop_peer", "close", "server_stop", "caller_gives_up"])
def test_a_pair_gone_while_it_warms_up_fails_its_handshake_at_once(
    start_node: Callable[..., Node], monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """While the pair's warm-up runs, the serving side drops the caller (it left the
    registry), closes its engine or stops its server, or the caller's deadline passes: the
    caller's handshake fails then (not when the warm-up is over, nor at the connect timeout);
    once the warm-up is over (it fails on an aborted communicator, or finds the stream gone)
    its thread ends and neither side keeps the pair; after a drop or a caller's timeout the
    next handshake works."""
    prefill, decode = start_node("p0", seed=1), start_node("d0", seed=2)
    gate = _GatedWarmUp(monkeypatch)
    timeout = 0.5 if how == "caller_gives_up" else 10
    request = kv_transfer_pb2.PullBlocksRequest(
        transfer_id="t0", block_indices=[0], expected_layout=LAYOUT, requester_id="d0"
    )
    peer = decode.peers.get(prefill.endpoint)
    started = time.monotonic()
    pulled = _in_thread(
        lambda: decode.engine.pull("p0", peer, request, [2], time.monotonic() + timeout)
    )
    assert gate.entered.wait(5)
    (pair,) = prefill.engine.pairs.all()
    if how == "drop_peer":
        assert prefill.engine.drop_peer("d0") == 1
    elif how == "close":
        prefill.engine.close()
    elif how == "server_stop":
        prefill.server.stop(0)
    error = pulled.exception(4)  # the warm-up is still held: the stream broke without it
    assert isinstance(error, NcclTransferError)
    if how == "caller_gives_up":
        assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 4  # its own deadline, not the connect timeout
    else:
        assert error.code == grpc.StatusCode.UNAVAILABLE
    assert decode.states() == {}
    gate.go.set()
    wait_until(lambda: not _link_threads("d0#0/pull"))
    wait_until(lambda: prefill.states() == {})
    assert not pair.link.alive  # type: ignore[union-attr]
    assert pair.comm.state.value == "aborted"
    if how in ("drop_peer", "caller_gives_up"):
        t = pull(decode, prefill, "t1", [3], [4])
        assert t.connect_s > 0 and same(decode, [4], prefill, [3])


@pytest.mark.parametrize("purpose", ["pull", "push"])
def test_a_request_sent_right_after_the_hello_is_served_after_the_warm_up(
    start_node: Callable[..., Node],
    fabric: Fabric,
    monkeypatch: pytest.MonkeyPatch,
    purpose: str,
) -> None:
    """A caller that does not wait for `ready` (its pull, or push_begin on a push pair, sent
    right behind the hello) is answered in order, `ready` first: a pull waits for the
    warm-up on the thread that serves it; a push pair is not warmed (its server's receives
    take another path)."""
    server = start_node("s0", seed=1)
    events: list[tuple[str, int]] = []
    real_warm = BlockMover.warm_pair

    def warm_pair(mover: BlockMover, comm: Any, chunk_bytes: int, deadline: float) -> None:
        real_warm(mover, comm, chunk_bytes, deadline)
        events.append(("warm", threading.get_ident()))

    class Receiver:
        def begin(self, request: Any, deadline: float, comm: Any, sender: str, done: Any) -> Any:
            events.append(("push", threading.get_ident()))
            done(None)  # nothing to receive
            return []

    monkeypatch.setattr(BlockMover, "warm_pair", warm_pair)
    server.engine.receiver = Receiver()
    real_refuse = NcclEngine._refuse
    monkeypatch.setattr(
        NcclEngine,
        "_refuse",
        lambda *a: events.append(("pull", threading.get_ident())) or real_refuse(*a),
    )
    uid = fabric.new_id()
    comm = FakeComms(fabric).start(uid, 0, "raw/r0")
    hello = kv_transfer_nccl_pb2.NcclConnectRequest(requester_id="c0", unique_id=uid)
    if purpose == "pull":  # never held: refused, and with no early post, no filler
        request = _Control(
            pull=kv_transfer_nccl_pb2.NcclPullRequest(
                blocks=kv_transfer_pb2.PullBlocksRequest(transfer_id="t0", block_indices=[0]),
                seq=1,
                timeout_ms=5000,
            )
        )
    else:
        hello.purpose = kv_transfer_nccl_pb2.NcclPurpose.NCCL_PURPOSE_PUSH
        request = _Control(
            push_begin=kv_transfer_nccl_pb2.NcclPushBeginRequest(
                requester_id="c0", layout=LAYOUT, seq=1, timeout_ms=5000
            )
        )
    done = threading.Event()

    def messages() -> Iterator[Any]:
        yield _Control(hello=hello)
        yield request
        done.wait(10)  # keep the stream open until both answers are in

    stub = kv_transfer_nccl_pb2_grpc.NcclKvTransferStub(server.peers.get(server.endpoint).channel)
    call = stub.Pair(messages(), timeout=10)
    kinds = [next(call).WhichOneof("kind") for _ in range(2)]
    done.set()
    call.cancel()
    assert kinds == ["ready", "verdict" if purpose == "pull" else "push_ready"]
    if purpose == "pull":
        assert [e[0] for e in events] == ["warm", "pull"]
        assert events[0][1] == events[1][1]  # one thread: the pair's server-side reader
    else:  # a push pair's server posts receives into its buffer: nothing to warm
        assert [e[0] for e in events] == ["push"]
    assert comm.posted == [] and comm.unclaimed == []  # no bytes either way


def test_a_pair_closed_by_its_server_before_the_caller_added_it_is_not_kept(
    start_node: Callable[..., Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill evicts a new pair just after its `ready` (its table is full), before decode's
    handshake has put the pair in its table: the stream ends, and decode does not keep the
    closed pair as an entry of its table; the next pull opens a new one."""
    prefill, decode = start_node("p0", seed=1, cap=1), start_node("d0", seed=2)
    table = decode.engine.pairs
    real_add = table.add

    def late_add(pair: Pair) -> None:  # the handshake thread, descheduled after `ready`
        monkeypatch.setattr(table, "add", real_add)
        wait_until(lambda: [p.users for p in prefill.engine.pairs.all()] == [0])
        assert prefill.engine.pairs.make_room() is True  # evicts it: `close` goes
        wait_until(lambda: not pair.link.alive)  # type: ignore[union-attr]
        real_add(pair)

    monkeypatch.setattr(table, "add", late_add)
    key = PairKey("p0", 0, Purpose.PULL)
    decode.engine.open(key, decode.peers.get(prefill.endpoint), time.monotonic() + 10)
    assert decode.states() == {}
    wait_until(lambda: prefill.states() == {})
    t = pull(decode, prefill, "t0", [1], [2])
    assert t.connect_s > 0 and decode.states() == {"p0#0/pull": "ready"}


def test_more_callers_than_the_servers_cap_all_pull_while_warm_ups_take_a_while(
    start_node: Callable[..., Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three decodes pull from a prefill capped at one communicator, each warm-up taking
    10 ms (a few ms on a GPU): pairs are evicted as they go idle, and every pull succeeds (a
    pair evicted while warming up failed its pull with "closed as it opened")."""
    real = BlockMover.warm_pair

    def slow(mover: BlockMover, comm: Any, chunk_bytes: int, deadline: float) -> None:
        time.sleep(0.01)  # the warm-up's work, not a wait for anything
        real(mover, comm, chunk_bytes, deadline)

    monkeypatch.setattr(BlockMover, "warm_pair", slow)
    prefill = start_node("p0", seed=1, cap=1)
    decodes = [start_node(f"d{i}", seed=2 + i) for i in range(3)]
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            pull(decodes[k % 3], prefill, f"t{k}", [k % 16], [(k + 1) % 16])
        except BaseException as exc:  # every transfer must succeed
            errors.append(exc)

    with futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(work, range(30)))
    assert errors == []
    assert prefill.engine.pairs.counters["evicted"] >= 2
    assert prefill.engine.pairs.counters["failed"] == 0
    wait_until(lambda: len(prefill.engine.pairs) <= 1)  # back under the cap once idle
