"""TCP transport through the real KvTransfer gRPC server on loopback (no vLLM engine)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch

from pdplane.connector.holds import HoldTable
from pdplane.connector.kv_cache import KvCacheView
from pdplane.connector.peers import PeerPool
from pdplane.connector.server import HoldAccess, start_kv_server, worker_services
from pdplane.connector.transports import TransferError, create_transport
from pdplane.connector.transports.base import PullRequest
from pdplane.connector.transports.tcp import TcpTransport
from pdplane.v1 import instance_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc

NUM_BLOCKS = 8
SHAPE = (NUM_BLOCKS, 2, 4, 16)  # CPU layout: block index first


def _caches(fill: bool, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    make = (
        (lambda: torch.randn(SHAPE, generator=gen).to(dtype))
        if fill
        else (lambda: torch.zeros(SHAPE, dtype=dtype))
    )
    return {f"model.layers.{i}.self_attn.attn": make() for i in range(2)}


@dataclass
class Prefill:
    holds: HoldTable
    caches: dict[str, torch.Tensor]
    endpoint: str


@pytest.fixture
def layout() -> instance_pb2.KvLayout:
    return instance_pb2.KvLayout(
        num_layers=2, num_kv_heads=2, head_size=8, block_size=4, dtype="float32"
    )


def _serve(
    layout: instance_pb2.KvLayout, token: str | None = None, dtype: torch.dtype = torch.float32
) -> Iterator[Prefill]:
    caches = _caches(True, dtype)
    transport = TcpTransport(chunk_bytes=600)  # < 1 block: one block per chunk
    transport.bind(KvCacheView(caches))
    holds = HoldTable()
    access = HoldAccess(holds, layout, arrival_wait_s=0.1)
    server = start_kv_server(worker_services(transport, access), "127.0.0.1:0", token=token)
    try:
        yield Prefill(holds, caches, f"127.0.0.1:{server.port}")
    finally:
        server.stop(0)


@pytest.fixture
def prefill(layout: instance_pb2.KvLayout) -> Iterator[Prefill]:
    yield from _serve(layout)


@pytest.fixture
def secured_prefill(layout: instance_pb2.KvLayout) -> Iterator[Prefill]:
    yield from _serve(layout, token="s3cret")


def _decoder() -> tuple[TcpTransport, dict[str, torch.Tensor]]:
    caches = _caches(False)
    transport = create_transport("tcp")
    assert isinstance(transport, TcpTransport)
    transport.bind(KvCacheView(caches))
    return transport, caches


def _request(layout: instance_pb2.KvLayout, tid: str = "t1", **kw: object) -> PullRequest:
    fields: dict = {
        "transfer_id": tid,
        "remote_block_indices": [0, 2],
        "local_block_ids": [5, 1],
        "expected_layout": layout,
        "deadline": time.monotonic() + 5,
    }
    fields.update(kw)
    return PullRequest(**fields)


def test_pull_writes_each_block_by_position(prefill: Prefill, layout) -> None:
    prefill.holds.add("req-p", "t1", [6, 3, 4], 60)  # prefill blocks of the transfer
    transport, caches = _decoder()
    pool = PeerPool()
    try:
        result = transport.pull(pool.get(prefill.endpoint), _request(layout))
    finally:
        pool.close()
    assert result.nbytes == 2 * 2 * 2 * 4 * 16 * 4  # layers x blocks x block bytes
    assert result.total_s > 0
    for name, dst in caches.items():
        src = prefill.caches[name]
        assert torch.equal(dst[5], src[6])  # position 0 -> prefill block 6 -> decode block 5
        assert torch.equal(dst[1], src[4])  # position 2 -> prefill block 4 -> decode block 1
        untouched = [b for b in range(NUM_BLOCKS) if b not in (1, 5)]
        assert not dst[untouched].any()


def test_bfloat16_blocks_round_trip(layout) -> None:
    bf16 = instance_pb2.KvLayout()
    bf16.CopyFrom(layout)
    bf16.dtype = "bfloat16"
    gen = _serve(bf16, dtype=torch.bfloat16)
    p = next(gen)
    try:
        p.holds.add("r", "t1", [2], 60)
        caches = _caches(False, torch.bfloat16)
        transport = TcpTransport()
        transport.bind(KvCacheView(caches))
        pool = PeerPool()
        transport.pull(
            pool.get(p.endpoint), _request(bf16, remote_block_indices=[0], local_block_ids=[7])
        )
        pool.close()
        assert all(torch.equal(caches[n][7], p.caches[n][2]) for n in caches)
    finally:
        gen.close()


@pytest.mark.parametrize(
    ("tid", "overrides", "code"),
    [
        ("unknown", {}, grpc.StatusCode.NOT_FOUND),
        ("t1", {"remote_block_indices": [0, 9], "local_block_ids": [1, 2]}, None),
        ("t1", {"expected_layout": instance_pb2.KvLayout(num_layers=3)}, None),
    ],
    ids=["unknown-transfer", "index-out-of-range", "layout-mismatch"],
)
def test_bad_pulls_fail_with_a_clear_status(
    prefill: Prefill, layout, tid: str, overrides: dict, code: grpc.StatusCode | None
) -> None:
    prefill.holds.add("req-p", "t1", [6, 3], 60)
    transport, _ = _decoder()
    pool = PeerPool()
    with pytest.raises(TransferError) as info:
        transport.pull(pool.get(prefill.endpoint), _request(layout, tid, **overrides))
    pool.close()
    assert info.value.code == (code or grpc.StatusCode.INVALID_ARGUMENT)


def test_pull_after_complete_is_refused_and_hold_reported_once(prefill: Prefill, layout) -> None:
    prefill.holds.add("req-p", "t1", [6, 3, 4], 60)
    pool = PeerPool()
    peer = pool.get(prefill.endpoint)
    reply = peer.stub(kv_transfer_pb2_grpc.KvTransferStub).CompleteTransfer(
        kv_transfer_pb2.CompleteTransferRequest(transfer_id="t1", success=True), timeout=5
    )
    assert reply.freed
    assert prefill.holds.pop_finished() == {"req-p"}
    transport, _ = _decoder()
    with pytest.raises(TransferError) as info:
        transport.pull(peer, _request(layout))
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    assert prefill.holds.pop_finished() == set()
    pool.close()


def test_pull_after_abort_says_why_the_hold_ended(prefill: Prefill, layout) -> None:
    # A client gone right after its first token: the gateway aborts prefill's hold while
    # decode is about to pull. Decode's log should say so, not just "not held".
    prefill.holds.add("req-p", "t1", [6, 3], 60)
    pool = PeerPool()
    peer = pool.get(prefill.endpoint)
    reply = peer.stub(kv_transfer_pb2_grpc.KvTransferStub).AbortTransfer(
        kv_transfer_pb2.AbortTransferRequest(transfer_id="t1", reason="cancelled" + "x" * 5000),
        timeout=5,
    )
    assert reply.freed
    transport, _ = _decoder()
    with pytest.raises(TransferError) as info:
        transport.pull(peer, _request(layout))
    pool.close()
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    assert "transfer t1 is not held: aborted: cancelledxxx" in str(info.value)
    assert len(str(info.value)) < 600  # the gateway's reason is bounded in the message
    assert len(prefill.holds.ended["t1"]) < 300  # and where it is kept


def test_pull_of_an_unknown_long_transfer_id_is_answered_bounded(prefill: Prefill, layout) -> None:
    transport, _ = _decoder()
    pool = PeerPool()
    with pytest.raises(TransferError) as info:
        transport.pull(pool.get(prefill.endpoint), _request(layout, "t" * 5000))
    pool.close()
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    # Prefill's answer (after decode's own "PullBlocks <id> from <endpoint>: <code>: ") quotes
    # at most 200 characters of the id.
    answer = str(info.value).split("NOT_FOUND: ", 1)[1]
    assert answer == f"transfer {'t' * 200} is not held: unknown, expired or freed"


def test_token_is_required_when_configured(secured_prefill: Prefill, layout) -> None:
    secured_prefill.holds.add("req-p", "t1", [6, 3, 4], 60)
    transport, caches = _decoder()
    anonymous, trusted = PeerPool(), PeerPool(token="s3cret")
    try:
        with pytest.raises(TransferError) as info:
            transport.pull(anonymous.get(secured_prefill.endpoint), _request(layout))
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert not any(c.any() for c in caches.values())
        transport.pull(trusted.get(secured_prefill.endpoint), _request(layout))
    finally:
        anonymous.close()
        trusted.close()


def test_expired_deadline_fails_before_any_call(prefill: Prefill, layout) -> None:
    prefill.holds.add("req-p", "t1", [6, 3, 4], 60)
    transport, _ = _decoder()
    pool = PeerPool()
    with pytest.raises(TransferError) as info:
        transport.pull(pool.get(prefill.endpoint), _request(layout, deadline=time.monotonic() - 1))
    pool.close()
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_kv_cache_view_finds_a_non_leading_block_axis() -> None:
    # GPU-style [2, num_blocks, block_size, heads, head_size]
    t = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)
    view = KvCacheView({"l0": t}, num_blocks=5)
    assert view.layers[0].block_dim == 1 and view.layers[0].block_shape == (2, 3)
    got = view.read_blocks(0, [4, 1])
    assert torch.equal(got[0], t[:, 4]) and torch.equal(got[1], t[:, 1])
    view.write_blocks(0, [0], got[:1])
    assert torch.equal(t[:, 0], t[:, 4])
    with pytest.raises(ValueError, match="expected"):
        view.write_blocks(0, [0, 1], got[:1])
    with pytest.raises(ValueError, match="out of range"):
        view.check_block_ids([5])


def test_unknown_transport_name_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown KV transport"):
        create_transport("carrier-pigeon")


def test_unknown_ids_are_answered_at_once_without_tying_up_the_pool(
    layout: instance_pb2.KvLayout,
) -> None:
    """16 AbortTransfer/CompleteTransfer calls for unknown ids, no deadline, on a server of 8
    workers whose arrival wait is 2 s: all answer (freed=false) and a health check gets through
    before any arrival wait could have ended; a hold arriving afterwards ends at once."""
    from concurrent import futures

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    holds = HoldTable()
    transport = TcpTransport()
    transport.bind(KvCacheView(_caches(False)))
    access = HoldAccess(holds, layout, arrival_wait_s=2.0)
    server = start_kv_server(worker_services(transport, access), "127.0.0.1:0")
    started = time.monotonic()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = kv_transfer_pb2_grpc.KvTransferStub(channel)
            with futures.ThreadPoolExecutor(16) as pool:
                calls = [
                    pool.submit(
                        stub.AbortTransfer,
                        kv_transfer_pb2.AbortTransferRequest(transfer_id=f"unknown-{i}"),
                    )
                    for i in range(12)
                ] + [
                    pool.submit(
                        stub.CompleteTransfer,
                        kv_transfer_pb2.CompleteTransferRequest(transfer_id=f"unknown-c{i}"),
                    )
                    for i in range(4)
                ]
                health = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
                answers = [c.result() for c in calls]
            elapsed = time.monotonic() - started
    finally:
        server.stop(0)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert [a.freed for a in answers] == [False] * 16
    assert elapsed < 2.0, f"unknown ids waited for the 2 s arrival wait ({elapsed:.2f} s)"
    # The abort is remembered: the hold, when it arrives, ends at once.
    holds.add("req-0", "unknown-0", [1, 2], timeout_s=60)
    assert holds.pop_finished() == {"req-0"}
