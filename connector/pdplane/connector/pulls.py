"""Decode side: pulls running in the background and their outcomes for vLLM.

The engine thread submits a pull (`submit`) and, on every step, collects finished ones
(`pop_finished`, then `pop_load_errors`) without ever blocking. A pull runs on a worker thread:
the transport fills the decode blocks (bounded by the pull timeout), then prefill is told to
free the transfer (CompleteTransfer). Whatever happens, the request is reported finished
receiving exactly once; on failure its blocks are reported as load errors in the same engine
step, so vLLM recomputes them or fails the request (`kv_load_failure_policy`).

Push mode: a load whose params say prefill pushed the blocks first takes them from this
worker's receive buffer (waiting up to `push_wait_s` for a push still arriving); only when no
usable push is there does it pull, and then any late push is discarded. Either way the same
single report to vLLM and the same CompleteTransfer to prefill follow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc

from pdplane.connector.metadata import LoadSpec, ReleaseSpec
from pdplane.connector.peers import PeerPool
from pdplane.connector.transports.base import KvTransport, PullRequest, TransferError
from pdplane.core import tracing
from pdplane.v1 import instance_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc

__all__ = ["PullStats", "Puller"]

log = logging.getLogger(__name__)

_CONTROL_TIMEOUT_S = 2.0


def _describe(exc: Exception) -> str:
    if isinstance(exc, grpc.Call):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)


@dataclass(frozen=True, slots=True)
class PullStats:
    """One finished pull (for logs and measurements)."""

    transfer_id: str
    ok: bool
    num_blocks: int
    nbytes: int
    seconds: float
    error: str = ""
    source: str = "pull"  # "push": taken from the receive buffer


class Puller:
    """Runs pulls for one decode worker (TP rank).

    Args:
        transport: moves the bytes.
        peers: channels to prefill instances.
        layout: this worker's KV layout (sent for prefill to check).
        requester_id: this instance's registry id.
        tp_rank: this worker's TP rank (pulls from the same rank of prefill).
        pull_timeout_s: bound on one pull, from submission (s).
        max_workers: concurrent pulls.
        push_wait_s: push mode: wait for an announced push still arriving (s).
    """

    def __init__(
        self,
        transport: KvTransport,
        peers: PeerPool,
        layout: instance_pb2.KvLayout,
        requester_id: str,
        tp_rank: int = 0,
        pull_timeout_s: float = 30.0,
        max_workers: int = 4,
        push_wait_s: float = 2.0,
    ) -> None:
        self._transport = transport
        self._push_wait_s = push_wait_s
        self._peers = peers
        self._layout = layout
        self._requester_id = requester_id
        self._tp_rank = tp_rank
        self._timeout_s = pull_timeout_s
        self._pool = futures.ThreadPoolExecutor(max_workers, thread_name_prefix="pdplane-pull")
        self._lock = threading.Lock()
        self._active: set[str] = set()
        self._done: list[tuple[str, tuple[int, ...]]] = []  # (req id, failed blocks)
        self._errors: set[int] = set()
        self.history: list[PullStats] = []  # last 1000 pulls

    @property
    def inflight(self) -> int:
        """Pulls submitted and not yet collected."""
        return len(self._active)

    def submit(self, spec: LoadSpec) -> None:
        """Starts a pull in the background; a request already being pulled is ignored."""
        with self._lock:
            if spec.req_id in self._active:
                log.error("request %s is already being pulled; ignoring", spec.req_id)
                return
            self._active.add(spec.req_id)
        deadline = time.monotonic() + self._timeout_s
        try:
            self._pool.submit(self._run, spec, deadline)
        except RuntimeError:  # pool shut down: fail it now rather than never
            self._finish(spec, PullStats(spec.transfer_id, False, 0, 0, 0.0, "shutting down"))

    def release(self, spec: ReleaseSpec) -> None:
        """Tells prefill to free a transfer decode will not pull (best effort, background)."""
        with contextlib.suppress(RuntimeError):  # pool shut down: prefill's timeout frees it
            self._pool.submit(self._abort, spec)

    def pop_finished(self) -> set[str]:
        """Request ids whose pull ended since the last call (each once); their failed blocks
        become available from the next `pop_load_errors`. Never blocks for long."""
        if not self._done:
            return set()
        with self._lock:
            done, self._done = self._done, []
            ids = set()
            for req_id, failed in done:
                self._active.discard(req_id)
                self._errors.update(failed)
                ids.add(req_id)
        return ids

    def pop_load_errors(self) -> set[int]:
        """Decode block ids that failed to load, for requests returned by `pop_finished`."""
        if not self._errors:
            return set()
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    def close(self) -> None:
        """Stops accepting pulls; running ones end by their deadline."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, spec: LoadSpec, deadline: float) -> None:
        # One span per transfer, in the request's trace (the gateway's context, carried in
        # kv_transfer_params); prefill's serving span is its child (gRPC metadata).
        attrs = {
            "pdplane.transfer_id": spec.transfer_id,
            "pdplane.blocks": len(spec.local_block_ids),
        }
        with tracing.span("pdplane.kv_pull", parent=spec.traceparent or None, attributes=attrs):
            ok = self._load(spec, deadline)
        self._complete(spec, ok)

    def _load(self, spec: LoadSpec, deadline: float) -> bool:
        """Moves the blocks and reports the load to vLLM; whether it succeeded."""
        start = time.monotonic()
        nbytes, error, source = 0, "", "pull"
        try:
            if spec.pushed:
                nbytes = self._take_pushed(spec, deadline)
                source = "push" if nbytes else "pull"
            if source == "pull":
                nbytes = self._pull(spec, deadline)
        except TransferError as exc:
            error = str(exc)
        except Exception as exc:  # any bug must still end the load, never hang the request
            log.exception("load of transfer %s", spec.transfer_id)
            error = f"{type(exc).__name__}: {exc}"
        stats = PullStats(
            spec.transfer_id,
            not error,
            len(spec.local_block_ids),
            nbytes,
            time.monotonic() - start,
            error,
            source,
        )
        # Report to vLLM first: a slow or dead prefill must not delay the decode request.
        self._finish(spec, stats)
        return not error

    def _take_pushed(self, spec: LoadSpec, deadline: float) -> int:
        """Bytes taken from the receive buffer; 0 = nothing usable there (pull instead)."""
        buffer = self._transport.receive_buffer
        if buffer is None:
            return 0
        try:
            return buffer.take(
                spec.transfer_id,
                spec.local_block_ids,
                deadline,
                sender_id=spec.sender_id,
                remote_block_indices=spec.remote_block_indices,
                wait_s=self._push_wait_s,
            )
        except TransferError as exc:
            log.info("transfer %s: %s; pulling instead", spec.transfer_id, exc)
            buffer.discard(spec.transfer_id, "pulled instead")
            return 0

    def _pull(self, spec: LoadSpec, deadline: float) -> int:
        try:
            peer = self._peers.get(spec.endpoint, self._tp_rank)
            if tracing.enabled():
                peer = dataclasses.replace(peer, metadata=tracing.grpc_metadata(peer.metadata))
            request = PullRequest(
                transfer_id=spec.transfer_id,
                remote_block_indices=spec.remote_block_indices,
                local_block_ids=spec.local_block_ids,
                expected_layout=self._layout,
                tp_rank=self._tp_rank,
                requester_id=self._requester_id,
                peer_id=spec.sender_id,
                deadline=deadline,
            )
            return self._transport.pull(peer, request).nbytes
        finally:
            buffer = self._transport.receive_buffer
            if spec.pushed and buffer is not None:  # a push arriving later is of no use
                buffer.discard(spec.transfer_id, "pulled instead")

    def _finish(self, spec: LoadSpec, stats: PullStats) -> None:
        if stats.ok:
            log.info(
                "transfer %s: %s %d blocks, %d bytes in %.1f ms",
                spec.transfer_id,
                "took pushed" if stats.source == "push" else "pulled",
                stats.num_blocks,
                stats.nbytes,
                stats.seconds * 1000,
            )
        else:
            log.warning("transfer %s: pull failed: %s", spec.transfer_id, stats.error)
        with self._lock:
            self.history.append(stats)
            del self.history[:-1000]
            self._done.append((spec.req_id, () if stats.ok else spec.local_block_ids))

    def _complete(self, spec: LoadSpec, ok: bool) -> None:
        try:
            peer = self._peers.get(spec.endpoint, self._tp_rank)
            peer.stub(kv_transfer_pb2_grpc.KvTransferStub).CompleteTransfer(
                kv_transfer_pb2.CompleteTransferRequest(transfer_id=spec.transfer_id, success=ok),
                timeout=_CONTROL_TIMEOUT_S,
                metadata=peer.metadata,
            )
        except (grpc.RpcError, ValueError) as exc:
            # Prefill frees the blocks at its own timeout anyway.
            log.info("CompleteTransfer %s failed: %s", spec.transfer_id, _describe(exc))

    def _abort(self, spec: ReleaseSpec) -> None:
        try:
            peer = self._peers.get(spec.endpoint, self._tp_rank)
            peer.stub(kv_transfer_pb2_grpc.KvTransferStub).AbortTransfer(
                kv_transfer_pb2.AbortTransferRequest(
                    transfer_id=spec.transfer_id, reason=spec.reason
                ),
                timeout=_CONTROL_TIMEOUT_S,
                metadata=peer.metadata,
            )
            log.info("transfer %s: released (%s)", spec.transfer_id, spec.reason)
        except (grpc.RpcError, ValueError) as exc:
            log.info("AbortTransfer %s failed: %s", spec.transfer_id, _describe(exc))
