"""The server's end of a pair (`NcclKvTransfer.Pair`): join the caller's communicator as rank 1,
warm the thread that serves it, then answer its requests in order on that thread: pulls (prefill
sends the held blocks, or refuses and sends the filler that completes decode's early receive)
and push begins (decode reserves room and posts receives). The pair table, handshakes and the
caller's side live in engine.py (`NcclEngine`, which this mixes into).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from pdplane.connector.transports.base import AccessDenied, BlockAccess
from pdplane.connector.transports.nccl.blocks import BlockMover
from pdplane.connector.transports.nccl.communicator import CommFactory
from pdplane.connector.transports.nccl.control import ServerLink
from pdplane.connector.transports.nccl.errors import NcclTransferError, code_of
from pdplane.connector.transports.nccl.pairs import Pair, PairKey, PairTable, Purpose
from pdplane.v1 import kv_transfer_nccl_pb2

__all__ = ["PairServing", "PushBegins", "ServeTiming"]

log = logging.getLogger(__name__)

#: bound on serving one request whose caller named no timeout (s)
_DEFAULT_SERVE_TIMEOUT_S = 60.0

_Control = kv_transfer_nccl_pb2.NcclControl


@dataclass(slots=True)
class ServeTiming:
    """Prefill's side of one pull, as `time.monotonic()` instants: request read from the stream,
    blocks pinned and checked, first message's send enqueued (then the verdict queued), all
    sends enqueued, sends complete."""

    transfer_id: str
    received: float
    pinned: float = 0.0
    first: float = 0.0
    enqueued: float = 0.0
    done: float = 0.0


class PushBegins(Protocol):
    """Decode's receive buffer as a push pair's server uses it (`push.PushReceiver`)."""

    def begin(
        self,
        request: kv_transfer_nccl_pb2.NcclPushBeginRequest,
        deadline: float,
        comm: Any,
        sender_id: str,
        done: Callable[[str | None], None],
    ) -> list[bool]: ...


class PairServing:
    """The serve side of `NcclEngine` (engine.py): the `Pair` handler and what its reader
    thread does with each request. Uses the engine's state named below."""

    mover: BlockMover
    chunk_bytes: int
    connect_timeout_s: float
    comms: CommFactory
    pairs: PairTable
    receiver: PushBegins | None
    access: BlockAccess | None
    serve_timings: deque[ServeTiming]
    on_send: Callable[[str], None] | None
    _closed: bool

    if TYPE_CHECKING:

        def fail(self, pair: Pair, reason: str) -> None: ...

        def _ended(self, pair: Pair, reason: str, clean: bool) -> None: ...

    def serve_pair(
        self,
        requests: Iterator[kv_transfer_nccl_pb2.NcclControl],
        context: grpc.ServicerContext,
    ) -> Iterator[kv_transfer_nccl_pb2.NcclControl]:
        """Serves `NcclKvTransfer.Pair`: joins the caller's communicator as rank 1, then, on a
        thread of the pair's own, warms the pair (`BlockMover.warm_pair`), sends `ready` and
        answers the caller's requests in order (a request sent before `ready` waits). Returns
        the response stream; aborts the call (INVALID_ARGUMENT, DEADLINE_EXCEEDED,
        UNAVAILABLE) when the handshake cannot be done; a warm-up that fails breaks it."""
        first = next(requests, None)
        if first is None or first.WhichOneof("kind") != "hello" or not first.hello.requester_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a Pair stream starts with a hello")
            raise AssertionError("unreachable")  # abort raises
        hello = first.hello
        try:
            purpose = Purpose(hello.purpose or Purpose.PULL)
        except ValueError:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown purpose {hello.purpose}")
            raise AssertionError("unreachable") from None
        if self._closed:
            context.abort(grpc.StatusCode.UNAVAILABLE, "shutting down")
        key = PairKey(hello.requester_id, hello.tp_rank, purpose)
        self.pairs.make_room()
        left = context.time_remaining()
        deadline = time.monotonic() + min(self.connect_timeout_s, left or self.connect_timeout_s)
        try:
            comm = self.comms.start(bytes(hello.unique_id), 1, f"{key}/r1")
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise AssertionError("unreachable") from None
        try:
            comm.wait_ready(deadline)
            comm.warm_up(deadline)
        except Exception as exc:
            comm.abort(f"handshake failed: {exc}")
            context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"NCCL handshake with {key.peer_id}: {exc}"
            )
        pair = Pair(key, comm, caller=False)
        link = ServerLink(
            lambda message: self._on_server_message(pair, message),
            lambda reason, clean: self._ended(pair, reason, clean),
            str(key),
        )
        pair.link = link
        # In use until `ready` is sent: an idle pair may be evicted, and a `close` sent before
        # `ready` would end a handshake the caller then counts as done.
        self.pairs.hold(pair)
        self.pairs.add(pair)

        def prepare() -> None:
            # On the thread that will serve the pair's pulls: its first CUDA calls (the
            # runtime's per-thread state, the copy path on the pair's streams) cost a first
            # pull ~1.3 ms on one H200 when made there by the request (docs/nccl.md). `ready`
            # follows, so a pre-connected pair is warm. A push pair's server (decode) posts
            # receives into its buffer instead, a path this warm-up does not take: warming it
            # would only cache a staging segment on the pair's stream.
            try:
                if purpose is Purpose.PULL:
                    with pair.lock:
                        self.mover.warm_pair(comm, self.chunk_bytes, deadline)
                link.send(_Control(ready=kv_transfer_nccl_pb2.NcclConnectResponse(ok=True)))
            finally:
                self.pairs.release(pair)

        link.start(requests, prepare)
        context.add_callback(lambda: link.cancel("call ended"))
        log.info("communicator %s joined", key)
        return link.responses()

    def _on_server_message(self, pair: Pair, message: kv_transfer_nccl_pb2.NcclControl) -> None:
        # The server's stream reader: requests are served one after the other, in order.
        kind = message.WhichOneof("kind")
        if kind == "pull":
            self._serve_pull(pair, message.pull)
        elif kind == "push_begin":
            self._serve_push_begin(pair, message.push_begin)
        else:
            log.warning("pair %s: unexpected %s from the caller", pair.key, kind)

    def _plan_chunk_bytes(self, plan: kv_transfer_nccl_pb2.NcclPlan) -> int:
        """The message size `plan` asks for (bytes; 0 = this side's default)."""
        return int(plan.chunk_bytes) or self.chunk_bytes

    def _serve_pull(self, pair: Pair, request: kv_transfer_nccl_pb2.NcclPullRequest) -> None:
        timing = ServeTiming(request.blocks.transfer_id, time.monotonic())
        timeout = request.timeout_ms / 1000 if request.timeout_ms else _DEFAULT_SERVE_TIMEOUT_S
        deadline = timing.received + timeout
        self.pairs.hold(pair)
        try:
            self._serve_pull_held(pair, request, deadline, timing)
        except Exception as exc:  # NCCL failed: the pair is of no use any more
            log.warning("pair %s: serving %s failed: %s", pair.key, timing.transfer_id, exc)
            self.fail(pair, f"serving transfer {timing.transfer_id}: {exc}")
        finally:
            self.pairs.release(pair)

    def _serve_pull_held(
        self,
        pair: Pair,
        request: kv_transfer_nccl_pb2.NcclPullRequest,
        deadline: float,
        timing: ServeTiming,
    ) -> None:
        access = self.access
        if access is None:
            self._refuse(pair, request, grpc.StatusCode.UNAVAILABLE, "not serving", deadline)
            return
        try:
            pinned = access.pin(request.blocks, deadline - time.monotonic())
        except AccessDenied as exc:
            self._refuse(pair, request, exc.code, str(exc), deadline)
            return
        with pinned:
            ids = pinned.block_ids
            try:
                chunk_bytes = self._plan_chunk_bytes(request.plan)
                self.mover.check_ids(ids)
                if request.early_bytes:
                    first = self.mover.first_message_bytes(len(ids), chunk_bytes)
                    if first != request.early_bytes:
                        raise ValueError(
                            f"plans differ: the caller posted {request.early_bytes} bytes first, "
                            f"this side would send {first}"
                        )
            except ValueError as exc:
                self._refuse(pair, request, grpc.StatusCode.INVALID_ARGUMENT, str(exc), deadline)
                return
            nbytes = self.mover.transfer_bytes(len(ids))
            timing.pinned = time.monotonic()
            answered = False

            def accept() -> None:
                # The verdict goes once the first message's send is enqueued: queueing it
                # wakes the stream's sender thread, which would otherwise take the GIL from
                # this one in the middle of launching the first gather and send (decode
                # already posted that receive; it needs the verdict only for the later ones).
                nonlocal answered
                answered = True
                timing.first = time.monotonic()
                pair.link.send(  # type: ignore[union-attr]
                    _Control(
                        verdict=kv_transfer_nccl_pb2.NcclVerdict(seq=request.seq, bytes=nbytes)
                    )
                )
                if self.on_send is not None:
                    self.on_send(timing.transfer_id)

            with pair.lock:
                self.mover.enqueue(pair.comm, True, ids, deadline, chunk_bytes, accept)
                if not answered:  # nothing to send
                    accept()
                timing.enqueued = time.monotonic()
                pair.comm.wait(deadline, "send")
            timing.done = time.monotonic()
            self.serve_timings.append(timing)

    def _refuse(
        self,
        pair: Pair,
        request: kv_transfer_nccl_pb2.NcclPullRequest,
        code: grpc.StatusCode,
        message: str,
        deadline: float,
    ) -> None:
        # The verdict first (decode waits for it before posting more), then the filler that
        # completes the one receive decode may have posted already.
        verdict = kv_transfer_nccl_pb2.NcclVerdict(
            seq=request.seq, code=code_of(code), message=message[:1000]
        )
        pair.link.send(_Control(verdict=verdict))  # type: ignore[union-attr]
        if request.early_bytes:
            with pair.lock:
                self.mover.send_filler(pair.comm, int(request.early_bytes), deadline)
                pair.comm.wait(deadline, "filler")

    def _serve_push_begin(
        self, pair: Pair, request: kv_transfer_nccl_pb2.NcclPushBeginRequest
    ) -> None:
        timeout = request.timeout_ms / 1000 if request.timeout_ms else _DEFAULT_SERVE_TIMEOUT_S
        deadline = time.monotonic() + timeout
        receiver, access = self.receiver, self.access

        def answer(code: grpc.StatusCode, message: str = "", spilled: Sequence[bool] = ()) -> None:
            ready = kv_transfer_nccl_pb2.NcclPushBeginResponse(
                seq=request.seq, code=code_of(code), message=message[:1000], spilled=spilled
            )
            pair.link.send(_Control(push_ready=ready))  # type: ignore[union-attr]

        if receiver is None or access is None:
            answer(grpc.StatusCode.UNIMPLEMENTED, "this worker takes no pushes")
            return
        try:
            access.check_layout(request.layout, who="sender")
        except AccessDenied as exc:
            answer(exc.code, str(exc))
            return

        def done(error: str | None) -> None:  # the receives completed (or failed)
            self.pairs.release(pair)
            if error:
                self.fail(pair, f"push receive: {error}")

        self.pairs.hold(pair)
        try:
            spilled = receiver.begin(request, deadline, pair.comm, pair.key.peer_id, done)
        except NcclTransferError as exc:
            self.pairs.release(pair)
            answer(exc.code, str(exc))
            if exc.code == grpc.StatusCode.ABORTED:
                self.fail(pair, str(exc))
            return
        answer(grpc.StatusCode.OK, spilled=spilled)
