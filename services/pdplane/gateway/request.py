"""One request on its way through the relay: what every request shares (`Shared`), the state of
one (`Request`), and the few decisions that read nothing else.

The steps of the request path (`pdplane.gateway.relay`) are functions of a `Request`, each in
its own module: Schedule (`schedule`), the legs to prefill and decode (`legs`), the
non-streamed answer (`json_reply`), the client's stream (`stream`), a decode taking over from
prefill's first token (`takeover`), a stream continued on another decode (`resume`; the
choices of a streamed n > 1 in `choice_legs`). They share the request's state here instead of
passing a dozen values along, and none of them imports another's caller.

A request makes one or more attempts (one Schedule each: a try on a pair, a decode taking
over, a resumed leg); `Request.care` is the current attempt's after-care
(`pdplane.gateway.aftercare.Aftercare`), replaced by every Schedule.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass

from pdplane.gateway.admission import AdmissionQueue
from pdplane.gateway.aftercare import Aftercare, Caretaker, KvAborter
from pdplane.gateway.bodies import migratable, takes_first_token
from pdplane.gateway.config import RelayConfig
from pdplane.gateway.departures import Departures
from pdplane.gateway.errors import GatewayError, bad_gateway
from pdplane.gateway.fanout import Choices
from pdplane.gateway.fleet_view import FleetView
from pdplane.gateway.metrics import GatewayMetrics
from pdplane.gateway.migration import Budget, Loss, Transcript, stop_lookback
from pdplane.gateway.prompt_ids import Tokenizers
from pdplane.gateway.replies import RetryElsewhere
from pdplane.gateway.route_note import RouteNote
from pdplane.gateway.upstream import UpstreamClient, UpstreamResponse, UpstreamTimeout
from pdplane.gateway.validation import COMPLETIONS, ClientRequest
from pdplane.gateway.warm import PrefixWarms
from pdplane.scheduler import InstanceRef, Outcome, SchedulerPort

__all__ = ["DecodeLost", "Request", "Shared", "Tally", "status_error"]

log = logging.getLogger(__name__)


class Shared:
    """What every request of one gateway shares: the clients, the queues, the knobs.

    Args:
        scheduler: the scheduler port (remote or local, `pdplane.scheduler.open_scheduler`).
        upstream: the pooled HTTP client to the instances.
        aborter: AbortTransfer client for KV held by prefill instances.
        metrics: where latencies, retries and cancellations are recorded.
        config: dispatch mode, timeouts, retries.
        tokenizers: the served models' tokenizers, if the gateway has them (the first token
            from prefill asks them whether a token without text ends inside a character;
            a stream with them may migrate).
        fleet: the registry's view: a model without a usable pair waits in the admission
            queue (None: only refusals for room wait).
    """

    def __init__(
        self,
        scheduler: SchedulerPort,
        upstream: UpstreamClient,
        aborter: KvAborter,
        metrics: GatewayMetrics,
        config: RelayConfig,
        tokenizers: Tokenizers | None = None,
        fleet: Callable[[], FleetView] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.upstream = upstream
        self.aborter = aborter
        self.metrics = metrics
        self.config = config
        self.tokenizers = tokenizers
        self.admission = AdmissionQueue(
            config.queue_timeout_s, config.max_queued_requests, metrics, fleet
        )
        self.caretaker = Caretaker(scheduler, aborter, metrics, self.admission.wake)
        #: streams by decode, moved off decodes that leave the registry or drain
        self.departures = Departures(config.drain_grace_s)
        #: Headers of every leg but `x-request-id` (a bearer token for `--upstream-api-key`).
        self.headers = {"content-type": "application/json"}
        if config.upstream_api_key:
            self.headers["authorization"] = f"Bearer {config.upstream_api_key}"
        #: the scheduler's prefix warms, sent in the background
        self.warms = PrefixWarms(upstream, self.headers, metrics, config.upstream_timeout_s)


class Request:
    """One request through the relay: its tries on scheduled pairs, its reply, its stream.

    Per try: `care` (the try's after-care), `prefill` / `decode` (its pair), `cached`
    (prefill's prefix cache hit for `--enable-prompt-tokens-details`; with no prefill leg the
    scheduler's count of decode's, `decode_cached`, which decode's own report overrides),
    `prefilled_at`.

    Args:
        relay: what all requests share.
        req: the client's request, validated.
        request_id: its id (X-Request-Id, made unique).
        started: its arrival, time.perf_counter() (s).
        max_model_len: the model's (tokens; 0 = unknown).
        note: gets every decision taken for it (the last one stays).
    """

    care: Aftercare  # set by each `pdplane.gateway.schedule.schedule`, with:
    decode: InstanceRef

    __slots__ = (
        "budget",
        "cached",
        "care",
        "choice",
        "decode",
        "decode_answered_ns",
        "decode_cached",
        "evicted",
        "excluded",
        "failed",
        "first_token",
        "headers",
        "id",
        "max_model_len",
        "note",
        "prefill",
        "prefilled_at",
        "relay",
        "req",
        "resp",
        "started",
        "streaming",
        "timeout_s",
        "tokenizer",
        "transcript",
        "tries_left",
    )

    def __init__(
        self,
        relay: Shared,
        req: ClientRequest,
        request_id: str,
        started: float,
        max_model_len: int,
        note: RouteNote | None,
    ) -> None:
        self.relay = relay
        self.req = req
        self.id = request_id
        self.started = started
        self.max_model_len = max_model_len
        self.note = note
        self.tries_left = relay.config.max_retries
        # instances that failed this request -> which process failed it (`exclude`)
        self.excluded: dict[str, int] = {}
        self.failed: RetryElsewhere | None = None  # the failure the current try follows
        self.headers = {**relay.headers, "x-request-id": request_id}
        self.timeout_s = relay.config.upstream_timeout_s
        # The first token from prefill: sequential dispatch only, as decode's prompt then
        # holds it. More tokens asked than the model holds take the usual path: decode, asked
        # one less, would serve max_model_len + 1 and name the wrong number when it refuses.
        self.first_token = (
            relay.config.first_token == "prefill"
            and relay.config.dispatch == "sequential"
            and not (max_model_len and req.max_tokens > max_model_len)
            and takes_first_token(req)
        )
        self.prefill: InstanceRef | None = None  # None: decode computes the prompt itself
        self.cached: int | None = None
        self.decode_cached = 0  # the decision's decode_cached_tokens (tokens)
        self.prefilled_at = 0.0  # time.perf_counter() at prefill's answer (its first token)
        self.decode_answered_ns = 0  # time.time_ns() at decode's response headers
        self.resp: UpstreamResponse | None = None  # decode's, once a stream has it
        self.streaming = False  # set once the stream generator started (it then settles)
        # Migration: the client's stream so far (None: this request is not resumed
        # elsewhere), resumes so far, when the first loss happened, why the leg was closed.
        # The model's tokenizer when the stream may migrate (kept: the fleet's may change).
        self.tokenizer = (
            relay.tokenizers.get(req.model)
            if relay.config.migration_limit and req.stream and relay.tokenizers is not None
            else None
        )
        self.transcript: Transcript | Choices | None = None
        if relay.config.migration_limit and migratable(req, self.tokenizer is not None):
            lookback = stop_lookback(req.body)
            offsets = req.endpoint == COMPLETIONS and req.body.get("logprobs") is not None
            n = req.body.get("n")
            self.transcript = (
                Choices(n, lookback, offsets)
                if isinstance(n, int) and n > 1
                else Transcript(lookback=lookback, text_offsets=offsets)
            )
        self.budget = Budget()  # shared with the choices of a streamed n > 1
        self.choice = 0  # the choice this request continues (n > 1, `for_choice`)
        self.evicted = ""

    def retrying(self, failed: RetryElsewhere, how: str) -> None:
        """Logs and counts a try given up on `failed`'s instance, which is then excluded."""
        log.warning("request %s: %s; %s", self.id, failed, how)
        self.relay.metrics.retries.labels(failed.side).inc()
        self.exclude(failed.instance_id)

    def exclude(self, instance_id: str) -> None:
        """Excludes `instance_id`, which failed this request, from its next Schedules as the
        process it is now (its registration in the fleet view): registered again (restarted
        under the same id), it may take the request (`AdmissionQueue.failed`)."""
        self.excluded[instance_id] = self.relay.admission.incarnation(self.req.model, instance_id)

    def restartable(self) -> bool:
        """Whether a non-streamed request whose decode is lost runs again on another pair
        (within `--migration-limit`): the client has seen nothing of it."""
        return not self.req.stream and self.relay.config.migration_limit > 0

    def for_choice(self, index: int, transcript: Transcript) -> Request:
        """Choice `index` of a streamed n > 1 (`transcript`: its stream so far) as a request
        of its own: a copy under its own id (`<id>-<index>`: its own Schedule and Release),
        with its own exclusions, sharing the migration budget (`budget` is the same object)."""
        child = copy.copy(self)
        child.id = f"{self.id}-{index}"
        child.headers = {**self.headers, "x-request-id": child.id}
        child.transcript = transcript
        child.excluded = dict(self.excluded)
        child.choice = index
        child.resp = None
        child.evicted = ""
        return child

    def settle_stream(self, error: BaseException | None) -> None:
        """Settles the stream's attempt (`error`: what ended it) and lets its leg go: back to
        the pool when it ended whole, closed otherwise (vLLM aborts what it still runs)."""
        outcome = self.care.settle(error)
        if self.resp is not None:
            if outcome is Outcome.SUCCESS:
                self.resp.release()
            else:
                self.resp.close()

    def abandon(self) -> None:
        """The reply was closed before its stream started (the client left first), so the
        stream's own `finally` never runs: settled here, as a closed stream would be."""
        if not self.streaming:
            self.streaming = True
            if self.resp is not None:
                self.resp.close()
            self.care.settle(GeneratorExit())

    def evict(self, reason: str) -> None:
        """Closes the stream's decode leg because its instance left (`deregistered`) or
        drained past its grace (`drain`): the stream continues on another decode
        (`pdplane.gateway.departures`)."""
        self.evicted = reason
        if self.resp is not None:
            self.resp.close()

    def decode_lost(self, name: str, exc: Exception | None, idle_s: float) -> Loss:
        """Why the stream's decode leg on `name` ended before its `[DONE]`: `exc` (connection
        lost, silent past `idle_s` seconds; None: closed before `[DONE]`), or the reason its
        leg was closed (`evict`)."""
        if self.evicted == "drain":
            return Loss("drain", 502, f"decode instance {name} drained past its grace")
        if self.evicted:
            return Loss(self.evicted, 502, f"decode instance {name} left the registry")
        if isinstance(exc, UpstreamTimeout):
            return Loss("idle", 504, f"decode instance {name} sent nothing for {idle_s:g} s")
        if exc is None:
            return Loss("lost", 502, f"decode instance {name} ended the stream before [DONE]")
        return Loss("lost", 502, f"decode instance {name} failed mid-stream: {exc}")


@dataclass(slots=True)
class Tally:
    """A stream's progress, for its metrics: events relayed, the first and last one's
    time.perf_counter() (s), whether decode sent any; `ok`: it ended whole (with `[DONE]`)."""

    events: int = 0
    first_at: float = 0.0
    last_at: float = 0.0
    from_decode: bool = False
    ok: bool = False


class DecodeLost(Exception):
    """A non-streamed request's decode was lost before its answer (`loss`): the request runs
    again on another pair, within `--migration-limit`."""

    def __init__(self, instance_id: str, loss: Loss) -> None:
        super().__init__(loss.message)
        self.instance_id = instance_id
        self.loss = loss


def status_error(side: str, instance_id: str, status: int, body: bytes) -> GatewayError:
    """The 502 for an instance's 5xx (`side`: prefill or decode; the first 300 bytes of its
    `body` quoted)."""
    excerpt = body[:300].decode(errors="replace")
    return bad_gateway(f"{side} instance {instance_id} answered {status}: {excerpt}")
