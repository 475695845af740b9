"""The worker-side NCCL transfer engine: pairs with peers, pulls (both sides), pre-connect.
The server's end of a pair (joining it, serving its requests) is in serving.py.

A pair (pairs.py) is one 2-rank communicator per (peer instance, TP rank, purpose) and the
control stream it was made over (`NcclKvTransfer.Pair`, control.py): the side that needs it
(decode for pulls, prefill for pushes) opens the stream with the NCCL unique id and becomes
rank 0; the peer joins as rank 1. Pairs are cached, capped (`max_peer_communicators`, least
recently used idle one evicted first), and dropped when a transfer on them fails, their stream
breaks or the peer leaves (`drop_peer`).

A pull costs one message each way on the pair's stream, and decode does not wait for the
answer before posting its first receive: it sends the request, posts the receive of the first
message and only then waits for prefill's verdict. Prefill answers every
request: the first send, the verdict (accepted), the other sends; or refused, then exactly
`early_bytes` of filler, so that the receive decode posted early is always matched (NCCL
cannot cancel a posted receive, and `ncclCommAbort` did not stop one nobody matched). The
rest of the receives are posted once the verdict arrived, which for a large transfer is long
before the first message is through.
Every wait is bounded by the pull's deadline; on a timeout or NCCL error the pair is aborted
and dropped on both sides.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from pdplane.connector.transports.base import BlockAccess, Peer
from pdplane.connector.transports.nccl.blocks import BlockMover
from pdplane.connector.transports.nccl.chunk_plan import DEFAULT_CHUNK_BYTES
from pdplane.connector.transports.nccl.communicator import CommFactory, NcclComms
from pdplane.connector.transports.nccl.control import CallerLink
from pdplane.connector.transports.nccl.errors import NcclTransferError, status_of
from pdplane.connector.transports.nccl.pairs import Pair, PairKey, PairTable, Purpose
from pdplane.connector.transports.nccl.serving import PairServing, PushBegins, ServeTiming
from pdplane.v1 import kv_transfer_nccl_pb2, kv_transfer_nccl_pb2_grpc, kv_transfer_pb2

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_MAX_PEER_COMMUNICATORS",
    "NcclEngine",
    "NcclTransferError",
    "PullTiming",
    "PushBegins",
    "ServeTiming",
]

log = logging.getLogger(__name__)

#: communicators per worker by default (docs/nccl.md has what they cost)
DEFAULT_MAX_PEER_COMMUNICATORS = 64
#: how long a pair asked to close may take to end its stream before it is aborted (s)
_CLOSE_GRACE_S = 5.0
#: concurrent handshakes of one `preconnect`
_PRECONNECT_WORKERS = 8

_Control = kv_transfer_nccl_pb2.NcclControl


@dataclass(slots=True)
class PullTiming:
    """What one pull cost, in seconds after `started` (`time.monotonic()`, comparable across
    processes of one host): `connect_s` setting up a pair first (0 when one was ready),
    `sent_s` request queued on the stream, `post_s` receives posted (all of them), `verdict_s`
    prefill's answer in, `total_s` bytes in the cache; and the bytes moved."""

    started: float = 0.0
    connect_s: float = 0.0
    sent_s: float = 0.0
    post_s: float = 0.0
    verdict_s: float = 0.0
    total_s: float = 0.0
    nbytes: int = 0


class _Refused(Exception):
    """Prefill refused a pull (its verdict)."""

    def __init__(self, verdict: Any) -> None:
        super().__init__(verdict.message)
        self.verdict = verdict


class NcclEngine(PairServing):
    """NCCL data path of one worker (one TP rank on one CUDA device).

    Args:
        device: CUDA device index of this worker's KV cache.
        views: the KV cache layers' byte views (`blocks.layer_byte_view`), model order.
        chunk_bytes: staging size (bytes) of the messages this receiver asks for (chunk_plan.py);
            senders follow the receiver's plan.
        connect_timeout_s: bound on creating a communicator (s).
        max_pairs: communicators at most (`max_peer_communicators`).
        comms: makes communicators (default: libnccl); tests pass a stand-in.
        mover: moves blocks (default: a `BlockMover` over `views`).
    """

    def __init__(
        self,
        device: int,
        views: Sequence[torch.Tensor],
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        connect_timeout_s: float = 30.0,
        max_pairs: int = DEFAULT_MAX_PEER_COMMUNICATORS,
        comms: CommFactory | None = None,
        mover: BlockMover | None = None,
    ) -> None:
        self.device = device
        self.mover = mover or BlockMover(views, device)
        self.chunk_bytes = chunk_bytes
        self.connect_timeout_s = connect_timeout_s
        self.comms: CommFactory = comms or NcclComms(device)
        self.pairs = PairTable(max_pairs, self._retire)
        self.instance_id = ""  # this instance's registry id: the requester id of our hellos
        self.receiver: PushBegins | None = None  # decode, push mode
        self.access: BlockAccess | None = None  # prefill: the connector's held blocks
        self.serve_timings: deque[ServeTiming] = deque(maxlen=1000)
        #: called with the transfer id once a served pull's first send is enqueued
        #: (observability: benchmarks and tests time and interrupt transfers with it)
        self.on_send: Callable[[str], None] | None = None
        self._gates: dict[PairKey, threading.Lock] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- pairs ----------------------------------------------------------------------------------

    def states(self) -> dict[str, dict[str, str]]:
        """{"active": {"peer#rank/purpose": communicator state}, "retired": {key: how it
        left: "evicted", "dropped", "failed", "closed", "replaced"}} (the latest per key)."""
        return {"active": self.pairs.states(), "retired": dict(self.pairs.retired)}

    def stats(self) -> dict[str, int]:
        """Gauge `communicators` and the cumulative counters `communicators_<counter>`."""
        out = {"communicators": len(self.pairs)}
        out.update({f"communicators_{k}": v for k, v in self.pairs.counters.items()})
        return out

    def _gate(self, key: PairKey) -> threading.Lock:
        with self._lock:
            return self._gates.setdefault(key, threading.Lock())

    def acquire(
        self,
        key: PairKey,
        peer: Peer,
        deadline: float,
        evict: bool = True,
    ) -> tuple[Pair, float]:
        """The pair for `key`, opened through `peer` if needed, counted in use until
        `release`. Returns (pair, seconds spent connecting). Raises NcclTransferError."""
        pair = self.pairs.acquire(key)
        if pair is not None:
            return pair, 0.0
        t0 = time.monotonic()
        for _ in range(3):  # a pair evicted or closed between open and acquire: open again
            self.open(key, peer, deadline, evict)
            pair = self.pairs.acquire(key)
            if pair is not None:
                return pair, time.monotonic() - t0
        raise NcclTransferError(f"pair {key} closed as it opened", grpc.StatusCode.UNAVAILABLE)

    def release(self, pair: Pair) -> None:
        self.pairs.release(pair)

    def open(self, key: PairKey, peer: Peer, deadline: float, evict: bool = True) -> bool:
        """Opens the pair for `key` unless one is up: this side calls (rank 0). Returns True
        when it opened one. `evict=False` (pre-connect) never evicts: RESOURCE_EXHAUSTED when
        the table is full. Raises NcclTransferError."""
        with self._gate(key):  # one handshake per key at a time; later callers reuse it
            if self.pairs.get(key) is not None:
                return False
            if self._closed:
                raise NcclTransferError("engine closed", grpc.StatusCode.UNAVAILABLE)
            if not self.pairs.make_room(evict) and not evict:
                raise NcclTransferError(
                    f"{len(self.pairs)} communicators, none idle (max_peer_communicators)",
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                )
            self._handshake(key, peer, min(deadline, time.monotonic() + self.connect_timeout_s))
            return True

    def _handshake(self, key: PairKey, peer: Peer, deadline: float) -> None:
        t0 = time.monotonic()
        uid = self.comms.unique_id()
        comm = self.comms.start(uid, 0, f"{key}/r0")
        pair = Pair(key, comm, caller=True)
        hello = _Control(
            hello=kv_transfer_nccl_pb2.NcclConnectRequest(
                requester_id=self.instance_id,
                tp_rank=key.tp_rank,
                unique_id=uid,
                purpose=kv_transfer_nccl_pb2.NcclPurpose.ValueType(key.purpose),
            )
        )
        try:
            stub = peer.stub(kv_transfer_nccl_pb2_grpc.NcclKvTransferStub)
            pair.link = CallerLink(
                stub.Pair,
                peer.metadata,
                hello,
                lambda message: self._on_caller_message(pair, message),
                lambda reason, clean: self._ended(pair, reason, clean),
                str(key),
            )
            comm.wait_ready(deadline)
            comm.warm_up(deadline)
            pair.ready.wait(deadline, "ready from the peer")
        except Exception as exc:
            if pair.link is not None:
                pair.link.cancel("handshake failed")
            comm.abort(f"handshake failed: {exc}")
            code = exc.code if isinstance(exc, NcclTransferError) else grpc.StatusCode.UNAVAILABLE
            if code == grpc.StatusCode.UNAVAILABLE and pair.ready.error:
                detail = pair.ready.error  # the peer's status says why
            else:
                detail = str(exc)
            raise NcclTransferError(
                f"NCCL handshake with {key.peer_id} at {peer.endpoint}: {detail}", code
            ) from None
        self.pairs.add(pair)
        if not pair.usable:
            # Closed since `ready` (the peer evicted it at once): its stream may have ended
            # before it was in the table, where `_ended` found nothing to take out.
            self.pairs.remove(pair, "closed")
            return
        log.info("communicator %s ready in %.0f ms", key, (time.monotonic() - t0) * 1000)

    def _on_caller_message(self, pair: Pair, message: kv_transfer_nccl_pb2.NcclControl) -> None:
        # The caller's stream reader: hand answers over, never block.
        kind = message.WhichOneof("kind")
        if kind == "ready":
            pair.ready.set(message.ready)
        elif kind == "verdict":
            pair.answer(message.verdict.seq, message.verdict)
        elif kind == "push_ready":
            pair.answer(message.push_ready.seq, message.push_ready)
        elif kind == "close":
            self._close(pair, f"peer: {message.close.reason}", "closed")
        else:
            log.warning("pair %s: unexpected %s from the server", pair.key, kind)

    def _close(self, pair: Pair, reason: str, how: str) -> None:
        """Closes `pair` gracefully once no transfer uses it (now when idle)."""
        if self.pairs.close_when_idle(pair, reason, how):
            self._retire(pair, reason, True)

    def fail(self, pair: Pair, reason: str) -> None:
        """Aborts `pair` on this side now (its stream ends: the peer aborts its side too)."""
        self.pairs.remove(pair, "failed")
        self._retire(pair, reason, False)

    def _retire(self, pair: Pair, reason: str, graceful: bool) -> None:
        # The pair is out of the table. Graceful: the caller ends its stream, and each side
        # frees the communicator when the stream ended (`_ended`); a stream that does not end
        # within the grace is broken. Otherwise now: abort and break the stream.
        link = pair.link
        pair.closing = pair.closing or reason
        if graceful and link is not None and link.alive:
            log.info("closing communicator %s: %s", pair.key, reason)
            link.close(reason)
            timer = threading.Timer(_CLOSE_GRACE_S, self._force, (pair, "close timed out"))
            timer.daemon = True
            timer.start()
            return
        self._force(pair, reason)

    def _force(self, pair: Pair, reason: str) -> None:
        if pair.link is not None and pair.link.alive:
            pair.link.cancel(reason)
        pair.comm.abort(reason)

    def _ended(self, pair: Pair, reason: str, clean: bool) -> None:
        # Either reader thread, once: the stream is over, so is the communicator. Clean: the
        # other side closed its half (it closes the pair too); else the stream broke.
        graceful = clean or bool(pair.closing)
        pair.closing = pair.closing or reason
        self.pairs.remove(pair, "closed" if graceful else "failed")
        pair.fail_waiters(reason)
        if graceful and pair.users == 0:
            pair.comm.close()
            log.info("communicator %s closed (%s)", pair.key, pair.closing)
        else:
            pair.comm.abort(f"control stream ended: {reason}")

    def drop_peer(self, peer_id: str, reason: str = "peer left") -> int:
        """Aborts every pair with instance `peer_id` (it left the registry; transfers on them
        fail at once). Returns how many."""
        pairs = self.pairs.by_peer(peer_id)
        for pair in pairs:
            if self.pairs.remove(pair, "dropped"):
                self._retire(pair, reason, False)
        return len(pairs)

    def close(self) -> None:
        """Releases every pair (connector shutdown)."""
        self._closed = True
        for pair in self.pairs.all():
            self.pairs.remove(pair, "closed")
            self._retire(pair, "shutting down", False)

    # -- pre-connect ----------------------------------------------------------------------------

    def preconnect(
        self, jobs: Sequence[Callable[[], bool]], deadline: float
    ) -> tuple[int, list[str]]:
        """Runs handshakes `jobs` (each returns True when it opened a pair) a few at a time,
        until `deadline`. Returns (pairs opened, errors)."""
        if not jobs:
            return 0, []
        opened, errors = 0, []
        pool = futures.ThreadPoolExecutor(_PRECONNECT_WORKERS, thread_name_prefix="nccl-pre")
        try:
            running = [pool.submit(job) for job in jobs]
            done, late = futures.wait(running, timeout=max(deadline - time.monotonic(), 0))
            for f in done:
                if f.exception() is not None:
                    errors.append(str(f.exception()))
                elif f.result():
                    opened += 1
            errors += ["pre-connect still running at its deadline"] * len(late)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return opened, errors

    # -- pull: caller side (decode) -------------------------------------------------------------

    def make_plan(self, chunk_bytes: int | None = None) -> kv_transfer_nccl_pb2.NcclPlan:
        """The plan this receiver asks for: messages of at most `chunk_bytes` (default the
        engine's)."""
        return kv_transfer_nccl_pb2.NcclPlan(chunk_bytes=chunk_bytes or self.chunk_bytes)

    def pull(
        self,
        peer_id: str,
        peer: Peer,
        request: kv_transfer_pb2.PullBlocksRequest,
        local_ids: Sequence[int],
        deadline: float,
        chunk_bytes: int | None = None,
        on_posted: Callable[[], None] | None = None,
    ) -> PullTiming:
        """Pulls the blocks `request` names from instance `peer_id` (reached at `peer`) into
        `local_ids` of this cache, in messages of at most `chunk_bytes` (default the engine's);
        `on_posted()` runs once all receives are posted.
        Returns the timing; raises NcclTransferError (the pair is aborted and dropped on NCCL
        failures; a refusal keeps it)."""
        timing = PullTiming(started=time.monotonic())
        if len(request.block_indices) != len(local_ids):
            raise NcclTransferError(
                f"{len(request.block_indices)} block indices but {len(local_ids)} local blocks",
                grpc.StatusCode.INVALID_ARGUMENT,
            )
        key = PairKey(peer_id or peer.endpoint, request.tp_rank, Purpose.PULL)
        pair, timing.connect_s = self.acquire(key, peer, deadline)
        try:
            self._pull_on(
                pair,
                request,
                local_ids,
                deadline,
                timing,
                chunk_bytes,
                on_posted,
            )
        finally:
            self.release(pair)
        timing.total_s = time.monotonic() - timing.started
        return timing

    def _pull_on(
        self,
        pair: Pair,
        request: kv_transfer_pb2.PullBlocksRequest,
        local_ids: Sequence[int],
        deadline: float,
        timing: PullTiming,
        chunk_bytes: int | None,
        on_posted: Callable[[], None] | None,
    ) -> None:
        plan = self.make_plan(chunk_bytes)
        chunk_bytes = self._plan_chunk_bytes(plan)
        early = 0
        if local_ids:
            early = self.mover.first_message_bytes(len(local_ids), chunk_bytes)
        comm, t0 = pair.comm, timing.started
        with pair.lock:
            seq, waiter = pair.expect()
            timeout_ms = max(int((deadline - time.monotonic()) * 1000), 1)
            call = kv_transfer_nccl_pb2.NcclPullRequest(
                blocks=request, plan=plan, seq=seq, early_bytes=early, timeout_ms=timeout_ms
            )
            pair.link.send(_Control(pull=call))  # type: ignore[union-attr]
            timing.sent_s = time.monotonic() - t0
            verdict: Any = None

            def gate() -> None:
                # Between the first receive and the others: decode posts the rest only for
                # an accepted request (a refusal's filler matches the first one).
                nonlocal verdict
                verdict = waiter.wait(deadline, "verdict")
                timing.verdict_s = time.monotonic() - t0
                if verdict.code:
                    raise _Refused(verdict)

            try:
                if early:
                    timing.nbytes = self.mover.enqueue(
                        comm, False, local_ids, deadline, chunk_bytes, gate
                    )
                else:
                    gate()
                    timing.nbytes = self.mover.enqueue(
                        comm, False, local_ids, deadline, chunk_bytes
                    )
                timing.post_s = time.monotonic() - t0
                if on_posted is not None:
                    on_posted()
                comm.wait(deadline)
            except _Refused:
                if early:  # only the first receive is posted: the filler completes it
                    try:
                        comm.wait(deadline, "filler")
                    except Exception as exc:
                        self.fail(pair, f"filler: {exc}")
                raise NcclTransferError(
                    f"pull from {pair.key.peer_id}: {verdict.message}", status_of(verdict.code)
                ) from None
            except NcclTransferError as exc:  # no verdict: the stream ended or timed out
                self.fail(pair, str(exc))
                raise
            except ValueError as exc:
                self.fail(pair, f"bad transfer: {exc}")
                raise NcclTransferError(str(exc), grpc.StatusCode.INVALID_ARGUMENT) from None
            except Exception as exc:
                self.fail(pair, str(exc))
                code = (
                    grpc.StatusCode.DEADLINE_EXCEEDED
                    if isinstance(exc, TimeoutError)
                    else grpc.StatusCode.ABORTED
                )
                raise NcclTransferError(f"pull from {pair.key.peer_id}: {exc}", code) from exc
        if verdict.bytes != timing.nbytes:
            raise NcclTransferError(
                f"peer sends {verdict.bytes} bytes, expected {timing.nbytes}",
                grpc.StatusCode.DATA_LOSS,
            )
