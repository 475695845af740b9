"""The prefill -> decode relay of one request (no FastAPI here: asyncio + the upstream client).

Per request: Schedule -> prefill leg -> decode leg -> relay decode's answer -> Release.
`Relay.handle` returns a `JsonReply` (non-streaming answers and upstream errors, passed through
unchanged) or a `StreamReply` (SSE relayed event by event), or raises `GatewayError`.

Failure handling (before any byte reached the client an attempt may be retried on another pair,
at most `max_retries` times, excluding the instance that failed):
- instance unreachable (refused, reset, closed before answering) -> retry, else 502;
- instance silent for `upstream_timeout_s` -> 504 (no retry: it may still be computing);
- instance answers 4xx -> that status and body, unchanged; 5xx -> 502 naming the instance;
- prefill's answer without usable `kv_transfer_params` -> 502 naming the prefill instance;
- decode fails after streaming began -> one `data: {"error": ...}` event, then close;
- cancellation (client gone) -> upstream requests closed (vLLM aborts them), KV held by
  prefill freed through `KvTransfer.AbortTransfer`, Release with outcome "cancelled".
Whenever prefill answered but decode did not finish, prefill's KV is freed the same way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from pdplane.core.kv_params import DecodeRequestParams
from pdplane.gateway.attempt import Attempt
from pdplane.gateway.errors import bad_request, unavailable
from pdplane.gateway.kv_abort import KvAborter
from pdplane.gateway.metrics import GatewayMetrics
from pdplane.gateway.replies import JsonReply, RetryElsewhere, StreamReply
from pdplane.gateway.upstream import UpstreamClient
from pdplane.gateway.validation import ClientRequest
from pdplane.scheduler.client import SchedulerError, SchedulerUnavailable

__all__ = [
    "Dispatch",
    "InlineRelease",
    "InstanceAddress",
    "Relay",
    "RelayConfig",
    "ScheduledPair",
    "SchedulerPort",
]

log = logging.getLogger(__name__)

Dispatch = Literal["sequential", "concurrent"]


class InstanceAddress(Protocol):
    """Where one side of a pair is: `scheduler_pb2.InstanceRef` or a scheduler `Candidate`."""

    @property
    def instance_id(self) -> str: ...

    @property
    def url(self) -> str: ...

    @property
    def kv_endpoint(self) -> str: ...


class ScheduledPair(Protocol):
    """A Schedule answer: `scheduler_pb2.ScheduleResponse` (remote) or the embedded scheduler's
    `Decision` (no protobuf built on the request path)."""

    @property
    def prefill(self) -> InstanceAddress: ...

    @property
    def decode(self) -> InstanceAddress: ...


class SchedulerPort(Protocol):
    """What the relay needs of the scheduler (`pdplane.scheduler.client.SchedulerClient`)."""

    async def schedule(
        self,
        request_id: str,
        model: str,
        prompt_tokens: int,
        max_tokens: int = 0,
        *,
        routing_key: str = "",
        exclude_instance_ids: Iterable[str] = (),
    ) -> ScheduledPair: ...

    async def release(self, request_id: str, outcome: str) -> bool: ...


@runtime_checkable
class InlineRelease(Protocol):
    """A scheduler that takes a Release without being awaited: embedded (a plain call) or
    `SchedulerClient` (batched onto the next Schedule). No background task per request, and a
    Release made before a retry's Schedule is applied before that decision."""

    def release_nowait(self, request_id: str, outcome: str) -> None: ...


@dataclass(frozen=True, slots=True)
class RelayConfig:
    """Relay knobs (see `pdplane.gateway.settings.GatewaySettings` for their meaning)."""

    dispatch: Dispatch = "sequential"
    upstream_timeout_s: float = 300.0
    max_retries: int = 1
    upstream_api_key: str | None = None


class Relay:
    """Relays requests through scheduled (prefill, decode) pairs.

    Args:
        scheduler: Schedule/Release client.
        upstream: the pooled HTTP client to the instances.
        aborter: AbortTransfer client for KV held by prefill instances.
        metrics: where latencies, retries and cancellations are recorded.
        config: dispatch mode, timeouts, retries.
    """

    def __init__(
        self,
        scheduler: SchedulerPort,
        upstream: UpstreamClient,
        aborter: KvAborter,
        metrics: GatewayMetrics,
        config: RelayConfig,
    ) -> None:
        self.scheduler = scheduler
        self.upstream = upstream
        self.aborter = aborter
        self.metrics = metrics
        self.config = config
        self._background: set[asyncio.Task[Any]] = set()
        self._release_nowait = (
            scheduler.release_nowait if isinstance(scheduler, InlineRelease) else None
        )

    async def handle(
        self, req: ClientRequest, request_id: str, started: float, max_model_len: int
    ) -> JsonReply | StreamReply:
        """Relays `req` under `request_id`; `started` = arrival (time.perf_counter()).

        `max_model_len` (tokens) caps the lengths sent to Schedule so that a request too long
        for the model still reaches an instance, whose own 400 is the authoritative answer.
        Raises GatewayError (400/502/503/504); asyncio.CancelledError after cleaning up.
        """
        excluded: list[str] = []
        last: RetryElsewhere | None = None
        for _ in range(self.config.max_retries + 1):
            pair = await self._schedule(req, request_id, excluded, last, max_model_len)
            try:
                return await Attempt(self, req, request_id, pair, started).run()
            except RetryElsewhere as retry:
                log.warning("request %s: %s; retrying on another pair", request_id, retry)
                self.metrics.retries.labels(retry.side).inc()
                excluded.append(retry.instance_id)
                last = retry
        assert last is not None
        raise last.error

    async def _schedule(
        self,
        req: ClientRequest,
        request_id: str,
        excluded: list[str],
        last: RetryElsewhere | None,
        max_model_len: int,
    ) -> ScheduledPair:
        prompt_tokens, max_tokens = req.prompt_tokens, req.max_tokens
        if max_model_len:
            prompt_tokens = min(prompt_tokens, max_model_len)
            max_tokens = min(max_tokens, max_model_len - prompt_tokens)
        try:
            return await self.scheduler.schedule(
                request_id,
                req.model,
                prompt_tokens,
                max_tokens,
                routing_key=req.routing_key,
                exclude_instance_ids=excluded,
            )
        except asyncio.CancelledError:
            # The scheduler may have counted the request before the client left; an unknown id
            # is harmless to Release.
            self.release_soon(request_id, "cancelled")
            raise
        except SchedulerUnavailable as exc:
            if last is not None:
                raise last.error from None  # no other pair: the failure is the answer
            raise unavailable(exc.reason) from None
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        except SchedulerError as exc:
            raise unavailable(f"scheduler error: {exc}") from None

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Runs `coro` in the background, keeping a reference until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def release_soon(self, request_id: str, outcome: str) -> None:
        """Release(request_id, outcome) off the request path (`InlineRelease`, else a
        background call); failures are logged."""
        if self._release_nowait is None:
            self.spawn(self.release(request_id, outcome))
            return
        try:
            self._release_nowait(request_id, outcome)
        except Exception as exc:
            log.warning("Release(%s, %s) failed: %s", request_id, outcome, exc)

    async def release_before_retry(self, request_id: str, outcome: str) -> None:
        """Release(request_id, outcome) that lands before the retry's Schedule of the same id
        (else it would end the new assignment's accounting)."""
        if self._release_nowait is None:
            await self.release(request_id, outcome)
        else:
            self.release_soon(request_id, outcome)

    async def release(self, request_id: str, outcome: str) -> None:
        """Release(request_id, outcome); failures are logged (the scheduler's lease-free
        accounting must not fail the client's request)."""
        try:
            await self.scheduler.release(request_id, outcome)
        except Exception as exc:
            log.warning("Release(%s, %s) failed: %s", request_id, outcome, exc)

    async def abort_transfer(self, params: DecodeRequestParams, reason: str) -> None:
        """AbortTransfer on the prefill instance holding `params`' KV; logged, never raised."""
        freed = await self.aborter.abort(params.kv_endpoint, params.transfer_id, reason)
        self.metrics.kv_aborts.labels("freed" if freed else "not_freed").inc()

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Waits (bounded) for background Release/AbortTransfer calls; used at shutdown."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout_s)
