"""The prefill -> decode relay of one request (no FastAPI here: asyncio + the upstream client).

Per request: Schedule -> prefill leg -> decode leg -> relay decode's answer -> Release.
A Schedule refused because every compatible instance is full waits in the admission queue
(`pdplane.gateway.admission`) for room, bounded, before it is a 503.
`Relay.handle` returns a `JsonReply` (non-streaming answers and upstream errors, passed through
unchanged) or a `StreamReply` (SSE relayed event by event), or raises `GatewayError`.

Failure handling (before any byte reached the client an attempt may be retried on another pair,
at most `max_retries` times, excluding the instance that failed):
- instance unreachable (refused, reset, closed before answering) -> retry, else 502;
- instance silent for `upstream_timeout_s` -> 504 (no retry: it may still be computing);
- instance answers 4xx -> that status and body, unchanged; 5xx -> 502 naming the instance;
- prefill's answer without usable `kv_transfer_params` -> 502 naming the prefill instance;
- decode fails after streaming began -> one `data: {"error": ...}` event, then close;
- with the first token from prefill (`pdplane.gateway.first_token`) streaming begins when
  prefill answers: a decode that cannot be reached then is replaced, within the same retries,
  by another decode computing the whole prompt itself (prefill's KV is freed), and the stream
  goes on; any other decode failure before its first byte is an error event, as above;
- cancellation (client gone) -> upstream requests closed (vLLM aborts them), KV held by
  prefill freed through `KvTransfer.AbortTransfer`, Release with outcome "cancelled".
Whenever prefill answered but decode did not finish, prefill's KV is freed the same way.
What an attempt leaves behind, and its outcome, is its `pdplane.gateway.aftercare.Aftercare`.
"""

from __future__ import annotations

import asyncio
import logging

from pdplane.core import tracing
from pdplane.gateway.admission import AdmissionQueue
from pdplane.gateway.aftercare import Aftercare, Caretaker
from pdplane.gateway.attempt import Attempt, Legs
from pdplane.gateway.config import RelayConfig
from pdplane.gateway.errors import bad_request, unavailable
from pdplane.gateway.kv_abort import KvAborter
from pdplane.gateway.metrics import GatewayMetrics
from pdplane.gateway.prompt_ids import Tokenizers
from pdplane.gateway.replies import JsonReply, RetryElsewhere, StreamReply
from pdplane.gateway.route_note import RouteNote
from pdplane.gateway.upstream import UpstreamClient
from pdplane.gateway.validation import ClientRequest
from pdplane.scheduler import (
    Decision,
    RequestFeatures,
    SchedulerBusy,
    SchedulerError,
    SchedulerPort,
    SchedulerUnavailable,
)

__all__ = ["Relay"]

log = logging.getLogger(__name__)


class Relay:
    """Relays requests through scheduled (prefill, decode) pairs.

    Args:
        scheduler: the scheduler port (remote or local, `pdplane.scheduler.open_scheduler`).
        upstream: the pooled HTTP client to the instances.
        aborter: AbortTransfer client for KV held by prefill instances.
        metrics: where latencies, retries and cancellations are recorded.
        config: dispatch mode, timeouts, retries.
        tokenizers: the served models' tokenizers, if the gateway has them.
    """

    def __init__(
        self,
        scheduler: SchedulerPort,
        upstream: UpstreamClient,
        aborter: KvAborter,
        metrics: GatewayMetrics,
        config: RelayConfig,
        tokenizers: Tokenizers | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self.config = config
        self.admission = AdmissionQueue(config.queue_timeout_s, config.max_queued_requests, metrics)
        self.caretaker = Caretaker(scheduler, aborter, metrics, self.admission.wake)
        self._legs = Legs.of(upstream, metrics, config, tokenizers)

    async def handle(
        self,
        req: ClientRequest,
        request_id: str,
        started: float,
        max_model_len: int,
        note: RouteNote | None = None,
    ) -> JsonReply | StreamReply:
        """Relays `req` under `request_id`; `started` = arrival (time.perf_counter()); `note`
        gets every decision taken for it (the last one stays).

        `max_model_len` (tokens) caps the lengths sent to Schedule so that a request too long
        for the model still reaches an instance, whose own 400 is the authoritative answer.
        Raises GatewayError (400/502/503/504); asyncio.CancelledError after cleaning up.
        """
        excluded: list[str] = []
        last: RetryElsewhere | None = None
        for tries in range(self.config.max_retries + 1):
            care = self.caretaker.begin(request_id)
            decision = await self._schedule(req, care, excluded, last, max_model_len)
            if note is not None:
                note.decision = decision
            take_over = _TakeOver(
                self,
                req,
                request_id,
                excluded,
                self.config.max_retries - tries,
                max_model_len,
                note,
            )
            attempt = Attempt(self._legs, care, req, decision, started, max_model_len, take_over)
            try:
                return await attempt.run()
            except RetryElsewhere as retry:
                self._retrying(request_id, retry, excluded, "retrying on another pair")
                last = retry
        assert last is not None
        raise last.error

    def _retrying(
        self, request_id: str, failed: RetryElsewhere, excluded: list[str], how: str
    ) -> None:
        """Logs and counts a retry of `request_id` after `failed`; excludes the instance."""
        log.warning("request %s: %s; %s", request_id, failed, how)
        self.metrics.retries.labels(failed.side).inc()
        excluded.append(failed.instance_id)

    async def _schedule(
        self,
        req: ClientRequest,
        care: Aftercare,
        excluded: list[str],
        last: RetryElsewhere | None,
        max_model_len: int,
        queue: bool | None = None,
    ) -> Decision:
        """The decision for `req` (`last`: the failure a retry follows, None at first).

        `queue`: whether a refusal for room waits in the admission queue; default: only the
        first try (a retry answers with `last`'s failure instead). A take-over after the
        first token waits: its stream has no other way to an answer.
        """
        if queue is None:
            queue = last is None
        prompt_tokens, max_tokens = req.prompt_tokens, req.max_tokens
        if max_model_len:
            prompt_tokens = min(prompt_tokens, max_model_len)
            max_tokens = min(max_tokens, max_model_len - prompt_tokens)
        features = RequestFeatures(
            care.request_id,
            req.model,
            prompt_tokens,
            max_tokens,
            routing_key=req.routing_key,
            exclude_instance_ids=tuple(excluded),
            prefix_hashes=req.prefix_hashes,
        )
        schedule = self.scheduler.schedule
        admission = self.admission
        try:
            with tracing.span("pdplane.schedule"):
                if queue and admission.has_waiters(req.model):
                    return await admission.admit(req.model, lambda: schedule(features), None)
                try:
                    return await schedule(features)
                except SchedulerBusy as busy:
                    if not queue:
                        raise  # a retry: the failure below is the answer
                    return await admission.admit(req.model, lambda: schedule(features), busy)
        except asyncio.CancelledError as exc:
            # The scheduler may have counted the request before the client left; an unknown id
            # is harmless to Release.
            care.settle(exc)
            raise
        except SchedulerUnavailable as exc:
            if last is not None:
                raise last.error from None  # no other pair: the failure is the answer
            raise unavailable(exc.reason) from None
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        except SchedulerError as exc:
            raise unavailable(f"scheduler error: {exc}") from None

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Waits (bounded) for background AbortTransfer calls; used at shutdown."""
        await self.caretaker.drain(timeout_s)


class _TakeOver:
    """Decodes that take over a stream whose decode could not be reached after the first token
    went out (`pdplane.gateway.attempt.TakeOver`), within the request's retries left (`tries`),
    excluding every instance that failed it."""

    __slots__ = (
        "_excluded",
        "_max_model_len",
        "_note",
        "_relay",
        "_req",
        "_request_id",
        "_tries",
    )

    def __init__(
        self,
        relay: Relay,
        req: ClientRequest,
        request_id: str,
        excluded: list[str],
        tries: int,
        max_model_len: int,
        note: RouteNote | None,
    ) -> None:
        self._note = note
        self._relay = relay
        self._req = req
        self._request_id = request_id
        self._excluded = excluded
        self._tries = tries
        self._max_model_len = max_model_len

    async def __call__(self, failed: RetryElsewhere) -> tuple[Aftercare, Decision] | None:
        if self._tries <= 0:
            return None
        self._tries -= 1
        relay = self._relay
        relay._retrying(self._request_id, failed, self._excluded, "another decode takes over")
        care = relay.caretaker.begin(self._request_id)
        decision = await relay._schedule(
            self._req, care, self._excluded, failed, self._max_model_len, queue=True
        )
        if self._note is not None:
            self._note.decision = decision
        return care, decision
