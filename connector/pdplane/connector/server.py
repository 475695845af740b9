"""The `pdplane.v1.KvTransfer` gRPC server of one worker (TP rank): prefill's side of a pull.

The servicer only checks a call and translates it: it grants access by transfer id (issued by
this instance, still held), checks the requester's KV layout and the block indices, pins the
hold while bytes are read, and hands the prefill block ids to the transport. Complete/Abort end
the hold. Sync gRPC (a thread pool), because it runs inside vLLM's engine process next to the
engine loop, which must never wait on it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures

import grpc

from pdplane.connector.holds import HeldTransfer, HoldTable, HoldUnknown
from pdplane.connector.transports.base import KvTransport
from pdplane.core import grpc_util, tracing
from pdplane.core.layout import fingerprint
from pdplane.v1 import instance_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc

__all__ = ["KvTransferServicer", "start_kv_server"]

log = logging.getLogger(__name__)

SERVICE_NAME = "pdplane.v1.KvTransfer"


def _serve_span(
    request: kv_transfer_pb2.PullBlocksRequest, context: grpc.ServicerContext, blocks: int
) -> contextlib.AbstractContextManager[object]:
    """Prefill's span for serving one pull, a child of decode's `pdplane.kv_pull`. Not made
    current: PullBlocks is a generator the gRPC server resumes once per chunk."""
    if not tracing.enabled():
        return contextlib.nullcontext()
    attrs = {"pdplane.transfer_id": request.transfer_id, "pdplane.blocks": blocks}
    return tracing.span(
        "pdplane.kv_serve",
        parent=tracing.grpc_parent(context),
        attributes=attrs,
        server=True,
        current=False,
    )


class KvTransferServicer(kv_transfer_pb2_grpc.KvTransferServicer):
    """Serves pulls of held transfers.

    Args:
        holds: this worker's held transfers.
        transport: moves the bytes (PullBlocks for TCP, SendBlocksNccl for NCCL).
        layout: this worker's KV layout; a requester with another layout is refused.
        arrival_wait_s: how long a pull (not an abort or complete: those answer at once) for a
            not-yet-known transfer id waits for the hold to arrive (prefill's response can
            reach decode before the engine's next step registers the hold) (s).
        tombstone_s: how long an abort/complete for an unknown id is remembered, so that the
            hold is freed at once if it arrives later (s).
    """

    def __init__(
        self,
        holds: HoldTable,
        transport: KvTransport,
        layout: instance_pb2.KvLayout,
        arrival_wait_s: float = 2.0,
        tombstone_s: float = 60.0,
    ) -> None:
        self._holds = holds
        self._transport = transport
        self._layout = layout
        self._fingerprint = fingerprint(layout)
        self._arrival_wait_s = arrival_wait_s
        self._tombstone_s = tombstone_s

    def _pin(
        self, request: kv_transfer_pb2.PullBlocksRequest, context: grpc.ServicerContext
    ) -> tuple[HeldTransfer, list[int]]:
        if not request.transfer_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "transfer_id is required")
        got = fingerprint(request.expected_layout)
        if got != self._fingerprint:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"KV layout mismatch: requester {got}, holder {self._fingerprint}",
            )
        wait = self._arrival_wait(context)
        try:
            hold = self._holds.pin(request.transfer_id, wait_s=wait)
        except HoldUnknown:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"transfer {request.transfer_id} is not held (unknown, expired or freed)",
            )
        indices: Sequence[int] = request.block_indices or range(len(hold.block_ids))
        bad = [i for i in indices if i >= len(hold.block_ids)]
        if bad:
            self._holds.unpin(hold)
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"block indices {bad[:8]} out of range: transfer holds {len(hold.block_ids)}",
            )
        return hold, [hold.block_ids[i] for i in indices]

    def _arrival_wait(self, context: grpc.ServicerContext) -> float:
        # Never wait past the caller's own deadline (it would only see DEADLINE_EXCEEDED).
        remaining = context.time_remaining()
        if remaining is None:
            return self._arrival_wait_s
        return min(self._arrival_wait_s, max(0.0, remaining - 0.1))

    def _release(self, transfer_id: str, reason: str, context: grpc.ServicerContext) -> bool:
        if not transfer_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "transfer_id is required")
        # No arrival wait: an unknown id is answered at once and remembered (tombstone), so a
        # hold arriving later still ends at once. Waiting held a pool worker per call: 16
        # AbortTransfer calls for unknown ids tied up all 8 workers for 2 s each.
        freed = self._holds.release(transfer_id, reason, 0.0, self._tombstone_s)
        log.info("transfer %s %s (freed=%s)", transfer_id, reason, freed)
        return freed

    def PullBlocks(
        self, request: kv_transfer_pb2.PullBlocksRequest, context: grpc.ServicerContext
    ) -> Iterator[kv_transfer_pb2.KvChunk]:
        hold, block_ids = self._pin(request, context)
        with _serve_span(request, context, len(block_ids)):
            try:
                yield from self._transport.serve_pull_blocks(block_ids, request, context)
            finally:
                self._holds.unpin(hold)

    def SendBlocksNccl(
        self, request: kv_transfer_pb2.PullBlocksRequest, context: grpc.ServicerContext
    ) -> kv_transfer_pb2.SendBlocksNcclResponse:
        hold, block_ids = self._pin(request, context)
        with _serve_span(request, context, len(block_ids)):
            try:
                return self._transport.serve_send_blocks_nccl(block_ids, request, context)
            finally:
                self._holds.unpin(hold)

    def CompleteTransfer(
        self, request: kv_transfer_pb2.CompleteTransferRequest, context: grpc.ServicerContext
    ) -> kv_transfer_pb2.CompleteTransferResponse:
        reason = "completed" if request.success else "completed (decode failed)"
        freed = self._release(request.transfer_id, reason, context)
        return kv_transfer_pb2.CompleteTransferResponse(freed=freed)

    def AbortTransfer(
        self, request: kv_transfer_pb2.AbortTransferRequest, context: grpc.ServicerContext
    ) -> kv_transfer_pb2.AbortTransferResponse:
        reason = f"aborted: {request.reason or 'no reason given'}"
        freed = self._release(request.transfer_id, reason, context)
        return kv_transfer_pb2.AbortTransferResponse(freed=freed)

    def NcclConnect(
        self, request: kv_transfer_pb2.NcclConnectRequest, context: grpc.ServicerContext
    ) -> kv_transfer_pb2.NcclConnectResponse:
        return self._transport.serve_nccl_connect(request, context)

    def PushBlocks(
        self,
        request_iterator: Iterator[kv_transfer_pb2.PushBlocksMessage],
        context: grpc.ServicerContext,
    ) -> kv_transfer_pb2.PushBlocksResponse:
        """Push mode (decode): the first message's header names the transfer and the sender's
        layout (refused unless equal to ours); the transport buffers the chunks that follow."""
        first = next(request_iterator, None)
        if first is None or not first.HasField("header") or not first.header.transfer_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "PushBlocks starts with a header")
            raise AssertionError("unreachable")  # abort raises
        header = first.header
        got = fingerprint(header.layout)
        if got != self._fingerprint:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"KV layout mismatch: sender {got}, receiver {self._fingerprint}",
            )
        return self._transport.serve_push_blocks(header, request_iterator, context)

    def NcclPushBegin(
        self, request: kv_transfer_pb2.NcclPushBeginRequest, context: grpc.ServicerContext
    ) -> kv_transfer_pb2.NcclPushBeginResponse:
        return self._transport.serve_nccl_push_begin(request, context)


def start_kv_server(
    servicer: KvTransferServicer,
    address: str,
    *,
    token: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    max_workers: int = 8,
    extra_services: Sequence[Callable[[grpc.Server], str]] = (),
    extra_workers: int = 0,
) -> tuple[grpc.Server, int]:
    """Starts a sync gRPC server with the KvTransfer service, health and reflection on
    `address` ("host:port", port 0 = any); bearer-token auth when `token` is set, TLS when
    cert and key are set. `extra_services` add more services to the same server (each returns
    its full name, e.g. `pdplane.v1.KvEvents`), `extra_workers` threads for their long-lived
    streams. Returns (server, bound port). Raises RuntimeError if it cannot bind."""
    interceptors = grpc_util.server_interceptors(token)
    server = grpc.server(
        futures.ThreadPoolExecutor(
            max_workers=max_workers + extra_workers, thread_name_prefix="pdplane-kv"
        ),
        interceptors=interceptors,
        options=grpc_util.SERVER_OPTIONS,
    )
    kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(servicer, server)
    names = [SERVICE_NAME, *(add(server) for add in extra_services)]
    grpc_util.add_health_and_reflection(server, names)
    port = grpc_util.add_port(server, address, tls_cert, tls_key)
    server.start()
    return server, port
