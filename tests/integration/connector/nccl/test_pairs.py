"""The NCCL engine's control plane on CPU: pairs over real gRPC servers on loopback, with the
CPU stand-ins for NCCL and CUDA (tests/unit/connector/nccl/fabric.py).

What is real: the pair table (cap, eviction), the `NcclKvTransfer.Pair` streams and
`Preconnect`, the connector's hold access, the message plan and the byte copies. The fake
NCCL asserts that every send meets a receive of exactly its size, so a receive posted before
prefill's verdict and never matched, or a filler of the wrong size, fails the test.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
import pytest

from pdplane.connector.transports.nccl.errors import NcclTransferError
from pdplane.v1 import kv_transfer_nccl_pb2, kv_transfer_nccl_pb2_grpc, kv_transfer_pb2
from tests.integration.connector.nccl.nodes import LAYOUT, NUM_BLOCKS, Node, pull, same, wait_until


def test_pulls_share_one_pair_and_its_stream(start_node: Callable[..., Node]) -> None:
    prefill, decode = start_node("p0", seed=1), start_node("d0", seed=2, chunk_bytes=256)
    first = pull(decode, prefill, "t0", [3, 9, 4], [1, 2, 15])
    assert first.connect_s > 0 and first.nbytes == 3 * 2 * 2 * 4 * 2 * 8 * 2
    assert same(decode, [1, 2, 15], prefill, [3, 9, 4])
    for i in range(1, 4):
        t = pull(decode, prefill, f"t{i}", [i, i + 5], [i + 8, i])
        assert t.connect_s == 0 and 0 < t.sent_s <= t.post_s <= t.total_s
        assert same(decode, [i + 8, i], prefill, [i, i + 5])
    assert decode.states() == {"p0#0/pull": "ready"}
    assert prefill.states() == {"d0#0/pull": "ready"}
    assert decode.engine.pairs.counters["created"] == 1
    assert len(decode.peers.get(prefill.endpoint)._stubs) == 1  # one stub, built once
    # prefill records a pull once its sends completed, which may be just after decode returns
    wait_until(lambda: len(prefill.engine.serve_timings) == 4)


def test_a_refused_pull_keeps_the_pair(start_node: Callable[..., Node]) -> None:
    prefill, decode = start_node("p0", seed=1), start_node("d0", seed=2, chunk_bytes=256)
    with pytest.raises(NcclTransferError) as err:
        pull(decode, prefill, "never-held", [4, 5], [1, 2], hold=False)
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    # The receive posted before the verdict (gather) was matched by filler: nothing dangles.
    (pair,) = decode.engine.pairs.all()
    assert pair.comm.posted == [] and pair.usable
    assert decode.engine.states()["retired"] == {}
    ok = pull(decode, prefill, "held", [4, 5], [1, 2])
    assert ok.connect_s == 0 and same(decode, [1, 2], prefill, [4, 5])


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
            pull(decode, p, f"t{k}", src[:1], dst)
        except BaseException as exc:  # every transfer must succeed
            errors.append(exc)

    with futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(work, range(24)))
    assert errors == []
    counters = decode.engine.pairs.counters
    assert counters["evicted"] >= 2 and counters["failed"] == 0
    wait_until(lambda: len(decode.engine.pairs) <= 2)  # back under the cap once idle
    # The prefills' sides closed with them, cleanly (stream ended, not broken).
    wait_until(lambda: sum(len(p.engine.pairs) for p in prefills) <= 2)
    assert all(p.engine.pairs.counters["failed"] == 0 for p in prefills)


def test_a_peer_gone_drops_its_pairs_on_both_sides(start_node: Callable[..., Node]) -> None:
    prefill, decode = start_node("p0", seed=1), start_node("d0", seed=2)
    pull(decode, prefill, "t0", [1], [2])
    assert decode.engine.drop_peer("p0") == 1
    assert decode.states() == {} and decode.engine.pairs.counters["dropped"] == 1
    wait_until(lambda: prefill.states() == {})  # the stream broke: prefill aborted its side
    # A new pair comes up on the next pull.
    t = pull(decode, prefill, "t1", [3], [4])
    assert t.connect_s > 0 and decode.states() == {"p0#0/pull": "ready"}


def test_a_dead_peer_breaks_the_stream_and_the_pair_goes(start_node: Callable[..., Node]) -> None:
    prefill, decode = start_node("p0", seed=1), start_node("d0", seed=2)
    pull(decode, prefill, "t0", [1], [2])
    prefill.server.stop(0)  # the process "died": its streams end
    wait_until(lambda: decode.states() == {})
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
    t = pull(decode, prefill, "t0", [1, 2], [3, 4])
    assert t.connect_s == 0  # the first request pays no handshake


def test_preconnect_never_evicts(start_node: Callable[..., Node]) -> None:
    decode = start_node("d0", cap=1)
    prefills = [start_node(f"p{i}", seed=i) for i in range(2)]
    pull(decode, prefills[0], "t0", [1], [2])
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
    pull(decode, prefill, "t0", [1], [2])
    done = threading.Event()
    threading.Thread(target=lambda: (decode.engine.close(), done.set()), daemon=True).start()
    assert done.wait(5)
    wait_until(lambda: prefill.states() == {})
