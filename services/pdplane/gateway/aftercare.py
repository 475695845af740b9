"""What one attempt of a request leaves behind, and the one place that decides how it ended.

An attempt (one Schedule of a request: a try on one pair, or a decode taking over) leaves:
- its assignment in the scheduler, ended by `Release(request_id, outcome)`;
- from the moment its prefill call goes out, the KV blocks prefill may hold for decode, freed
  through `KvTransfer.AbortTransfer` (`KvAborter`) unless decode finished (it pulled them, and
  prefill freed them): when the client goes away, decode refuses or fails, or another pair
  takes over, prefill frees the blocks then instead of at its hold timeout. This includes a
  prefill call given up on before its answer was read (the client left, a time budget ran
  out, the stream ended for another reason): prefill may have finished already, and vLLM does
  not abort a finished request, so its blocks are held under the transfer id the gateway gave
  it (`PrefillRequestParams.transfer_id`); an abort that comes before the hold ends the hold as
  soon as it starts (the connector remembers it);
- background calls (AbortTransfer) that outlive the request: bounded by a timeout, failures
  logged, never raised.

`Aftercare` is that for one attempt: the request path (`pdplane.gateway.relay`) reports facts
(`expect_kv`, `hold_kv`, `nothing_held`, `free_kv`, `succeeded`) and calls `settle` wherever
the attempt ends (its last leg, its stream, or its reply dropped unread); `settle` decides the
outcome and does the rest, once.
`Caretaker` holds what all attempts share: the scheduler port, the AbortTransfer client,
metrics, background tasks.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc

from pdplane.core.grpc.util import aio_channel, token_metadata
from pdplane.core.kv_params import DecodeRequestParams
from pdplane.gateway.metrics import GatewayMetrics
from pdplane.gateway.replies import RetryElsewhere
from pdplane.scheduler import Outcome, SchedulerPort
from pdplane.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

__all__ = ["Aftercare", "Caretaker", "KvAborter"]

log = logging.getLogger(__name__)

#: Channels kept open to this many prefill KvTransfer endpoints (least recently used closed first).
_MAX_CHANNELS = 256


class KvAborter:
    """Sends `AbortTransfer` to prefill instances' KvTransfer servers over cached channels.

    Args:
        token: bearer token for the KvTransfer servers, if they require one.
        tls_ca: PEM file of the CA when they serve TLS.
        timeout_s: deadline of one AbortTransfer call (s).
    """

    def __init__(
        self, *, token: str | None = None, tls_ca: str | Path | None = None, timeout_s: float = 2.0
    ) -> None:
        self._metadata = token_metadata(token)
        self._tls_ca = tls_ca
        self._timeout_s = timeout_s
        self._stubs: OrderedDict[str, tuple[grpc.aio.Channel, kv_transfer_pb2_grpc.KvTransferStub]]
        self._stubs = OrderedDict()

    async def _stub(self, endpoint: str) -> kv_transfer_pb2_grpc.KvTransferStub:
        entry = self._stubs.get(endpoint)
        if entry is None:
            if len(self._stubs) >= _MAX_CHANNELS:
                _, (old, _) = self._stubs.popitem(last=False)
                await old.close(grace=self._timeout_s)
            channel = aio_channel(endpoint, self._tls_ca)
            entry = (channel, kv_transfer_pb2_grpc.KvTransferStub(channel))
            self._stubs[endpoint] = entry
        else:
            self._stubs.move_to_end(endpoint)
        return entry[1]

    async def abort(self, kv_endpoint: str, transfer_id: str, reason: str) -> bool:
        """Asks the prefill instance at `kv_endpoint` (host:port) to free `transfer_id` now.

        Returns whether prefill freed blocks; False on any error (logged).
        """
        request = kv_transfer_pb2.AbortTransferRequest(transfer_id=transfer_id, reason=reason)
        try:
            stub = await self._stub(kv_endpoint)
            reply = await stub.AbortTransfer(
                request, timeout=self._timeout_s, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "AbortTransfer(%s) at %s failed: %s %s",
                transfer_id,
                kv_endpoint,
                exc.code().name,
                exc.details(),
            )
            return False
        return bool(reply.freed)

    async def close(self) -> None:
        """Closes every cached channel."""
        stubs, self._stubs = self._stubs, OrderedDict()
        for channel, _ in stubs.values():
            await channel.close()


class Caretaker:
    """The after-care every attempt of one gateway shares.

    Args:
        scheduler: where Releases go (`release_nowait`: no task per request, and a Release made
            before a retry's Schedule is applied before that decision).
        aborter: AbortTransfer client for KV held by prefill instances.
        metrics: where cancellations and KV aborts are counted.
        released: called after every Release (the admission queue's `wake`: room may have
            come for a waiting request).
    """

    def __init__(
        self,
        scheduler: SchedulerPort,
        aborter: KvAborter,
        metrics: GatewayMetrics,
        released: Callable[[], None] | None = None,
    ) -> None:
        self._scheduler = scheduler
        self._aborter = aborter
        self._metrics = metrics
        self._released = released
        self._background: set[asyncio.Task[Any]] = set()

    def begin(self, request_id: str) -> Aftercare:
        """The after-care of an attempt of `request_id` about to be scheduled."""
        return Aftercare(self, request_id)

    def release(self, request_id: str, outcome: Outcome) -> None:
        """Release(request_id, outcome) off the request path; failures are logged (the
        scheduler expires what is never released, the client's answer must not fail)."""
        try:
            self._scheduler.release_nowait(request_id, outcome)
        except Exception as exc:
            log.warning("Release(%s, %s) failed: %s", request_id, outcome, exc)
        if self._released is not None:
            self._released()

    def abort_kv(self, kv_endpoint: str, transfer_id: str, reason: str) -> None:
        """AbortTransfer of `transfer_id`, in the background, on the prefill instance whose
        KvTransfer server is `kv_endpoint` (host:port)."""
        self._spawn(self._abort(kv_endpoint, transfer_id, reason))

    async def _abort(self, kv_endpoint: str, transfer_id: str, reason: str) -> None:
        freed = await self._aborter.abort(kv_endpoint, transfer_id, reason)
        self._metrics.kv_aborts.labels("freed" if freed else "not_freed").inc()

    def cancelled(self) -> None:
        """Counts one request cancelled by its client."""
        self._metrics.cancellations.inc()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Waits (bounded, seconds) for background AbortTransfer calls; used at shutdown."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout_s)


class Aftercare:
    """One attempt's after-care: its Release, the KV its prefill holds, its background calls.

    The attempt reports facts, then calls `settle` where it ends; only `settle` decides the
    outcome. `outcome` is None until then.
    """

    __slots__ = ("_caretaker", "_kv", "_succeeded", "outcome", "request_id")

    def __init__(self, caretaker: Caretaker, request_id: str) -> None:
        self._caretaker = caretaker
        self.request_id = request_id
        #: (prefill's KvTransfer host:port, transfer id) of KV prefill holds or may hold
        self._kv: tuple[str, str] | None = None
        self._succeeded = False
        self.outcome: Outcome | None = None

    def expect_kv(self, kv_endpoint: str, transfer_id: str) -> None:
        """A prefill call is going out: until its answer is read, prefill may hold KV under
        `transfer_id` (the gateway's choice) at `kv_endpoint` that only this attempt can
        free (vLLM aborts an unfinished request whose client left, not a finished one)."""
        self._kv = (kv_endpoint, transfer_id)

    def hold_kv(self, params: DecodeRequestParams) -> None:
        """Prefill answered: it holds the KV `params` name until decode pulls it."""
        self._kv = (params.kv_endpoint, params.transfer_id)

    def nothing_held(self) -> None:
        """Prefill holds nothing for this attempt: it answered an error, or the request never
        reached it."""
        self._kv = None

    def free_kv(self, reason: str) -> None:
        """Decode will not pull the held KV (it refused, failed, or another pair takes over;
        or the prefill call was given up on): AbortTransfer now, in the background. At most
        once per attempt."""
        if self._kv is not None:
            self._caretaker.abort_kv(*self._kv, reason)
            self._kv = None

    def succeeded(self) -> None:
        """The whole answer reached the client (decode pulled the KV, and prefill freed it)."""
        self._succeeded = True

    def settle(self, error: BaseException | None = None) -> Outcome:
        """Ends the attempt: decides its outcome, frees held KV unless it succeeded, counts a
        cancellation, and releases the request with that outcome. Idempotent.

        The outcome, from `error` (what ended the attempt, None when it returned):
        - SUCCESS: `succeeded()` was called and nothing was raised;
        - CANCELLED: the client left: `asyncio.CancelledError` (the request's task was
          cancelled) or `GeneratorExit` (its stream was closed, or dropped unread);
        - FAILED: anything else, a `RetryElsewhere` included (the retry reuses the request id;
          this Release reaches the scheduler before the retry's Schedule).
        """
        if self.outcome is not None:
            return self.outcome
        if error is None:
            outcome = Outcome.SUCCESS if self._succeeded else Outcome.FAILED
        elif isinstance(error, (asyncio.CancelledError, GeneratorExit)):
            outcome = Outcome.CANCELLED
        else:
            outcome = Outcome.FAILED
        self.outcome = outcome
        if outcome is not Outcome.SUCCESS:
            retrying = isinstance(error, RetryElsewhere)
            self.free_kv("retrying on another pair" if retrying else outcome.value)
        if outcome is Outcome.CANCELLED:
            self._caretaker.cancelled()
        self._caretaker.release(self.request_id, outcome)
        return outcome
