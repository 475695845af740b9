"""NcclKvTransfer.SendBlocks's early acceptance over a real gRPC server on loopback (no GPU needed).

Decode posts its NCCL receives only after prefill's initial metadata said "accepted"; this
checks that the metadata reaches the caller while the handler is still running (a plain unary
call would deliver it only with the response) and that refusals surface with their status.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from pdplane.connector.transports.nccl.rpc import ACCEPTED_METADATA, SendBlocksCall
from pdplane.core import grpc_util
from pdplane.v1 import kv_transfer_nccl_pb2, kv_transfer_nccl_pb2_grpc, kv_transfer_pb2


class _Servicer(kv_transfer_nccl_pb2_grpc.NcclKvTransferServicer):
    def __init__(self) -> None:
        self.release = threading.Event()

    def SendBlocks(self, request: Any, context: grpc.ServicerContext) -> Any:
        if request.blocks.transfer_id != "held":
            context.abort(
                grpc.StatusCode.NOT_FOUND, f"transfer {request.blocks.transfer_id} not held"
            )
        context.send_initial_metadata((ACCEPTED_METADATA,))
        # The sends would run here; they end only once the caller posted its receives.
        if not self.release.wait(timeout=10):
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "caller never released")
        return kv_transfer_nccl_pb2.NcclSendBlocksResponse(
            bytes_sent=len(request.blocks.block_indices)
        )


def _request(transfer_id: str = "", indices: tuple[int, ...] = ()) -> Any:
    blocks = kv_transfer_pb2.PullBlocksRequest(transfer_id=transfer_id, block_indices=indices)
    return kv_transfer_nccl_pb2.NcclPullRequest(blocks=blocks)


@pytest.fixture
def server() -> Iterator[tuple[_Servicer, str]]:
    servicer = _Servicer()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    kv_transfer_nccl_pb2_grpc.add_NcclKvTransferServicer_to_server(servicer, srv)
    port = grpc_util.add_port(srv, "127.0.0.1:0")
    srv.start()
    yield servicer, f"127.0.0.1:{port}"
    servicer.release.set()
    srv.stop(grace=None)


def test_acceptance_arrives_before_the_response(server: tuple[_Servicer, str]) -> None:
    servicer, endpoint = server
    channel = grpc_util.channel(endpoint)
    try:
        call = SendBlocksCall(channel, _request("held", (1, 2, 3)), timeout_s=10)
        assert call.accepted() is True
        assert not servicer.release.is_set()  # the handler is still "sending"
        servicer.release.set()
        assert call.result().bytes_sent == 3
    finally:
        channel.close()


def test_a_refused_call_is_not_accepted_and_keeps_its_status(
    server: tuple[_Servicer, str],
) -> None:
    _, endpoint = server
    channel = grpc_util.channel(endpoint)
    try:
        call = SendBlocksCall(channel, _request("unknown"), timeout_s=10)
        assert call.accepted() is False
        with pytest.raises(grpc.RpcError) as err:
            call.result()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "unknown" in (err.value.details() or "")
    finally:
        channel.close()


def test_an_unreachable_peer_fails_within_the_deadline() -> None:
    channel = grpc_util.channel("127.0.0.1:1")  # nothing listens there
    try:
        call = SendBlocksCall(channel, _request(), timeout_s=2)
        assert call.accepted() is False
        with pytest.raises(grpc.RpcError) as err:
            call.result()
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        channel.close()
