"""The gRPC server of one worker (TP rank) and the held blocks it serves.

The server hosts any number of services (`ServiceBinding`): `KvTransfer` (complete, abort: the
end of a hold; its servicer is `pdplane.connector.servicer`), the transport's own service(s)
(`KvTransport.services`), and whatever else the connector serves next to them; it adds health
and reflection for all of them. Transports reach held blocks only through `HoldAccess` (the
`BlockAccess` of transports/base.py): it grants access by transfer id (issued by this instance,
still held), checks the requester's KV layout and the block indices, and pins the hold while
bytes are read. Sync gRPC (a thread pool), because it runs inside vLLM's engine process next to
the engine loop, which must never wait on it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from pdplane.connector.holds import HeldTransfer, HoldTable, HoldUnknown
from pdplane.connector.servicer import REASON_CHARS, SERVICE_NAME, KvTransferServicer
from pdplane.connector.transports.base import AccessDenied, KvTransport, ServiceBinding
from pdplane.core import tracing
from pdplane.core.grpc import util as grpc_util
from pdplane.core.instance.layout import fingerprint
from pdplane.v1 import instance_pb2, kv_transfer_pb2

__all__ = ["HoldAccess", "KvServer", "start_kv_server", "worker_services"]

log = logging.getLogger(__name__)

#: server threads beyond the services' long-lived streams
_BASE_WORKERS = 8


def _serve_span(
    request: kv_transfer_pb2.PullBlocksRequest, context: Any, blocks: int
) -> contextlib.AbstractContextManager[object]:
    """Prefill's span for serving one pull, a child of decode's `pdplane.kv_pull`. Not made
    current: a streaming handler is a generator the gRPC server resumes once per message."""
    if context is None or not tracing.enabled():
        return contextlib.nullcontext()
    attrs = {"pdplane.transfer_id": request.transfer_id, "pdplane.blocks": blocks}
    return tracing.span(
        "pdplane.kv_serve",
        parent=tracing.grpc_parent(context),
        attributes=attrs,
        server=True,
        current=False,
    )


class _Pinned:
    """One read of held blocks (`HoldAccess.pin`); released once. As a context manager it is
    also the read's tracing span."""

    def __init__(
        self,
        holds: HoldTable,
        hold: HeldTransfer,
        block_ids: list[int],
        span: contextlib.AbstractContextManager[object],
    ) -> None:
        self._holds = holds
        self._hold: HeldTransfer | None = hold
        self.block_ids = block_ids
        self._span = span

    def release(self) -> None:
        if self._hold is not None:
            hold, self._hold = self._hold, None
            self._holds.unpin(hold)

    def __enter__(self) -> _Pinned:
        self._span.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.release()
        finally:
            self._span.__exit__(None, None, None)


class HoldAccess:
    """This worker's held blocks as transports may use them (`BlockAccess`).

    Args:
        holds: this worker's held transfers.
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
        layout: instance_pb2.KvLayout,
        arrival_wait_s: float = 2.0,
        tombstone_s: float = 60.0,
    ) -> None:
        self.holds = holds
        self.layout = layout
        self.fingerprint = fingerprint(layout)
        self.arrival_wait_s = arrival_wait_s
        self.tombstone_s = tombstone_s

    def check_layout(self, layout: instance_pb2.KvLayout, who: str = "requester") -> None:
        got = fingerprint(layout)
        if got != self.fingerprint:
            raise AccessDenied(
                f"KV layout mismatch: {who} {got}, this worker {self.fingerprint}",
                grpc.StatusCode.INVALID_ARGUMENT,
            )

    def arrival_wait(self, time_remaining: float | None) -> float:
        """How long to wait for a hold not known yet: never past the caller's own deadline
        (it would only see DEADLINE_EXCEEDED)."""
        if time_remaining is None:
            return self.arrival_wait_s
        return min(self.arrival_wait_s, max(0.0, time_remaining - 0.1))

    def pin(
        self,
        request: kv_transfer_pb2.PullBlocksRequest,
        time_remaining: float | None = None,
        context: Any = None,
    ) -> _Pinned:
        if not request.transfer_id:
            raise AccessDenied("transfer_id is required", grpc.StatusCode.INVALID_ARGUMENT)
        self.check_layout(request.expected_layout)
        try:
            hold = self.holds.pin(
                request.transfer_id, self.arrival_wait(time_remaining), request.requester_id
            )
        except HoldUnknown:
            # Why it ended, when this prefill knows (an abort races decode's pull when the
            # client leaves right after its first token): decode's log then says so.
            why = self.holds.ended.get(request.transfer_id) or "unknown, expired or freed"
            raise AccessDenied(
                f"transfer {request.transfer_id[:REASON_CHARS]} is not held: {why}",
                grpc.StatusCode.NOT_FOUND,
            ) from None
        indices: Sequence[int] = request.block_indices or range(len(hold.block_ids))
        bad = [i for i in indices if i >= len(hold.block_ids)]
        if bad:
            self.holds.unpin(hold)
            raise AccessDenied(
                f"block indices {bad[:8]} out of range: transfer holds {len(hold.block_ids)}",
                grpc.StatusCode.INVALID_ARGUMENT,
            )
        ids = [hold.block_ids[i] for i in indices]
        return _Pinned(self.holds, hold, ids, _serve_span(request, context, len(ids)))

    def release(self, transfer_id: str, reason: str) -> bool:
        """Ends the hold of `transfer_id` (see `HoldTable.release`); False when not held.

        No arrival wait: an unknown id is answered at once and remembered (tombstone), so a
        hold arriving later still ends at once. Waiting held a pool worker per call: 16
        AbortTransfer calls for unknown ids tied up all 8 workers for 2 s each."""
        freed = self.holds.release(transfer_id, reason, 0.0, self.tombstone_s)
        log.info("transfer %s %s (freed=%s)", transfer_id, reason, freed)
        return freed


def worker_services(transport: KvTransport, access: HoldAccess) -> list[ServiceBinding]:
    """`KvTransfer` plus the transport's own services, all serving through `access`."""
    return [KvTransferServicer(access.release).binding(), *transport.services(access)]


@dataclass
class KvServer:
    """A running worker server: its port and health (`set_ready` flips the readiness that
    the instance's registration waits for, see registration.py)."""

    server: grpc.Server
    port: int
    health: health.HealthServicer

    def set_ready(self, ready: bool) -> None:
        """SERVING / NOT_SERVING for `pdplane.v1.KvTransfer` (the worker's readiness)."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self.health.set(SERVICE_NAME, status)

    def stop(self, grace: float | None) -> None:
        """Stops the server, waiting at most `grace` + 1 s."""
        self.server.stop(grace).wait((grace or 0.0) + 1.0)


def start_kv_server(
    services: Sequence[ServiceBinding],
    address: str,
    *,
    token: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    ready: bool = True,
) -> KvServer:
    """Starts a sync gRPC server with `services`, health and reflection on `address`
    ("host:port", port 0 = any); bearer-token auth when `token` is set, TLS when cert and key
    are set; readiness (`KvServer.set_ready`) starts as `ready`. Raises RuntimeError if it
    cannot bind."""
    interceptors = grpc_util.server_interceptors(token)
    workers = _BASE_WORKERS + sum(s.threads for s in services)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pdplane-kv"),
        interceptors=interceptors,
        options=grpc_util.KV_SERVER_OPTIONS,
    )
    for service in services:
        service.register(server)
    health_servicer = grpc_util.add_health_and_reflection(server, [s.name for s in services])
    port = grpc_util.add_port(server, address, tls_cert, tls_key)
    server.start()
    kv = KvServer(server, port, health_servicer)
    kv.set_ready(ready)
    return kv
