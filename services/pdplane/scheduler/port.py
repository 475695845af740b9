"""The scheduler's public port: what a caller (the gateway) sends, gets back and may expect.

One definition of each thing that crosses the seam between the gateway and the scheduler:

- `RequestFeatures`: what a decision is made from (one request's features);
- `Decision`: the chosen instances and the policies' reason;
- `Outcome`: how a scheduled request ended (`release`);
- `SchedulerPort`: schedule / release / release_nowait / close;
- `SchedulerUnavailable` (its `SchedulerBusy` kind: instances exist but are all full now) /
  `SchedulerError` (and `ValueError` for invalid input): its errors.

Two implementations, built by `pdplane.scheduler.factory.open_scheduler`: remote
(`pdplane.scheduler.remote.RemoteScheduler`, gRPC to a `pdplane scheduler` process) and local
(`pdplane.scheduler.local.LocalScheduler`, the same decision code in the caller's process).
Protobuf stays behind the seam: `pdplane.scheduler.wire` is the one place that converts these
types to and from `pdplane.v1.scheduler_pb2`.

Adding a request feature: a field of `RequestFeatures`, the field of `ScheduleRequest` in
`scheduler.proto`, and its line in each direction of `wire`; nothing else changes on the way.
A decision may have no prefill instance (decode computes the prompt itself: conditional
disaggregation; on the wire an empty prefill `InstanceRef`), and carries the predicted prefix
cache hits per side.

This module imports no scheduler internals, so callers may depend on it alone.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pdplane.core.grpc.echo import echo
from pdplane.v1 import instance_pb2

if TYPE_CHECKING:
    import grpc

__all__ = [
    "EMBEDDED",
    "Decision",
    "InstanceRef",
    "InstanceSource",
    "Outcome",
    "PolicyFlags",
    "PortSettings",
    "RequestFeatures",
    "SchedulerBusy",
    "SchedulerError",
    "SchedulerPort",
    "SchedulerUnavailable",
    "WarmHint",
]

#: `PortSettings.scheduler` value that selects the local (in-process) implementation.
EMBEDDED = "embedded"


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """One request's features, the whole input of a scheduling decision.

    Attributes:
        request_id: the id the request is counted under until `release` (at most 1024
            characters; scheduling an id still in flight replaces its assignment: a retry).
        model: the served model name.
        prompt_tokens: prompt length in tokens (exact, or an estimate); > 0.
        max_tokens: tokens to generate; 0 = unknown.
        routing_key: optional key for `consistent_hash` ("" = none).
        prefix_block_hashes: uint64 hashes of the prompt's full KV cache blocks, in order;
            empty when unknown. The key of `consistent_hash` when given (any hash a client
            chooses); a scheduler falls back to `prefix_hashes` when it is empty.
        exclude_instance_ids: instances not to choose (e.g. ones that just failed this request).
        prefill_policy / decode_policy: per-request policy names; "" = the scheduler's default.
        prefix_hashes: block size (tokens per KV cache block) -> the prompt's exact chained
            block hashes at that size (`pdplane.core.prefix_hash.block_hashes` of the token ids
            the engine will compute, one uint64 per full block, in order: ints, or a uint64
            numpy array, as a scheduler process receives them); one entry per block size among
            the model's instances, empty when the token ids are unknown. What `kv_aware`
            matches against the prefix index.
        first_token_from_prefill: the client's first token comes from prefill's answer (the
            gateway's first token from prefill, docs/first-token.md), not from decode.
    """

    request_id: str
    model: str
    prompt_tokens: int
    max_tokens: int = 0
    routing_key: str = ""
    prefix_block_hashes: Sequence[int] = ()
    exclude_instance_ids: Collection[str] = ()
    prefill_policy: str = ""
    decode_policy: str = ""
    prefix_hashes: Mapping[int, Sequence[int]] = field(default_factory=dict)
    first_token_from_prefill: bool = False


class InstanceRef(Protocol):
    """Where one side of a decision is: enough to send it work.

    Satisfied by the remote answer's `scheduler_pb2.InstanceRef` and by the local scheduler's
    candidates, so neither implementation copies per request.
    """

    @property
    def instance_id(self) -> str: ...

    @property
    def url(self) -> str:
        """The instance's OpenAI base URL, e.g. "http://10.0.0.5:8000"."""
        ...

    @property
    def kv_endpoint(self) -> str:
        """host:port of the instance's `KvTransfer` gRPC server."""
        ...

    @property
    def transport(self) -> instance_pb2.Transport.ValueType: ...


@dataclass(frozen=True, slots=True)
class Decision:
    """A scheduling decision: the prefill and the decode instance, and the policies' reason,
    e.g. "prefill least_loaded: load=0.42 of 2; decode round_robin: 3/4".

    `prefill` None: decode already holds all but a few prompt tokens and computes them itself;
    the caller sends the original request to decode (no prefill leg, no kv_transfer_params).
    `prefill_cached_tokens` / `decode_cached_tokens`: the prefix index's predicted prefix cache
    hit of the prompt on each side (tokens, whole KV cache blocks; 0 = none or unknown).
    """

    prefill: InstanceRef | None
    decode: InstanceRef
    reason: str = ""
    prefill_cached_tokens: int = 0
    decode_cached_tokens: int = 0
    warm: WarmHint | None = None


@dataclass(frozen=True, slots=True)
class WarmHint:
    """Prefix warming (`pdplane.scheduler.warming`): many requests read this request's first
    `prefix_tokens` tokens (whole KV cache blocks) and prefill `instance`, idle, does not hold
    them. The caller sends `instance` those tokens as a request of its own (prompt token ids,
    one output token, no `kv_transfer_params`) and forgets its answer; nothing is released.
    """

    instance: InstanceRef
    prefix_tokens: int


class Outcome(enum.StrEnum):
    """How a scheduled request ended, as told to `release` (scheduler metrics label it).

    `UNSPECIFIED` is the wire's zero value: a caller that did not say. The scheduler accepts
    and counts it; pdplane's gateway always sends one of the other three.
    """

    SUCCESS = "success"
    FAILED = "failed"
    CANCELLED = "cancelled"
    UNSPECIFIED = "unspecified"

    @classmethod
    def parse(cls, value: str) -> Outcome:
        """`value` ("success", ... or an `Outcome`) as an Outcome; ValueError otherwise."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            known = sorted(o.value for o in cls)
            raise ValueError(f"outcome must be one of {known}, got {echo(value)}") from None


class SchedulerError(Exception):
    """The scheduler failed in a way other than "no pair" or "invalid input".

    `reason` is its message; `code` the gRPC status of a remote scheduler (None locally), e.g.
    `grpc.StatusCode.UNAUTHENTICATED`.
    """

    def __init__(self, reason: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(f"{code.name}: {reason}" if code is not None else reason)
        self.code = code
        self.reason = reason


class SchedulerUnavailable(SchedulerError):
    """No compatible pair right now, or the scheduler cannot be reached in time (gateway: 503).

    `reason` names what is missing, e.g. "no prefill instance for model 'tiny': ...".
    """


class SchedulerBusy(SchedulerUnavailable):
    """Compatible instances exist but every one was turned down for capacity (e.g. no decode
    KV room for the request): a later Schedule may succeed once requests end, so a caller may
    wait and ask again (the gateway's admission queue) instead of answering 503 at once.

    A remote scheduler answers it as RESOURCE_EXHAUSTED; an older scheduler answers the same
    refusal as UNAVAILABLE, which reads as a plain `SchedulerUnavailable`.
    """


class SchedulerPort(Protocol):
    """What a caller needs of the scheduler; every implementation raises the same errors."""

    async def schedule(self, features: RequestFeatures) -> Decision:
        """Chooses a (prefill, decode) pair and counts it in flight until `release`.

        Raises ValueError (invalid field, unknown policy name), SchedulerBusy (compatible
        instances, all full now), SchedulerUnavailable (no compatible prefill, decode or pair;
        or the scheduler unreachable or late) and SchedulerError (anything else, e.g. a
        refused token).
        """
        ...

    async def release(self, request_id: str, outcome: Outcome) -> bool:
        """Ends the in-flight accounting of `request_id`; False when it was not in flight.

        Raises ValueError on an empty id or an unknown outcome; remote errors as `schedule`.
        """
        ...

    def release_nowait(self, request_id: str, outcome: Outcome) -> None:
        """`release` without waiting (call from the event loop): applied before any later
        `schedule` of this port, failures logged. Raises ValueError as `release`."""
        ...

    def problem(self) -> str | None:
        """Why the port cannot decide now (e.g. "scheduler unreachable at <address>"), for the
        gateway's /health; None when it can. Cheap, never blocks; call from the event loop."""
        ...

    async def start(self) -> None:
        """Starts what the port runs in the background, in the event loop that will use it
        (a local port's in-flight exchange with its peers); call once, before `schedule`."""
        ...

    async def close(self) -> None:
        """Delivers what `release_nowait` still holds and frees the port's resources."""
        ...


class InstanceSource(Protocol):
    """The registry as a local scheduler reads it: a revision and the instances at it.

    `revision` must change whenever `snapshot()` may have (a decision re-reads only then), and
    sources replace a changed instance's message instead of mutating it. A source may also say
    what changed since a cursor (`changes_since`, `pdplane.scheduler.view.ChangeSource`, as
    the registry client's `InstanceWatcher` does): a heartbeat then costs a decision one
    instance, not a pass over the view.
    """

    @property
    def revision(self) -> int: ...

    def snapshot(self) -> Mapping[str, instance_pb2.Instance]: ...


class PolicyFlags(Protocol):
    """The decision flags of a local scheduler (`pdplane.scheduler.settings.PolicySettings`):
    default policy names per side, in-flight expiry (seconds), seed of randomised policies,
    the prefix index's (on/off, staleness after seconds or events behind, events batching
    interval in ms, size bound), kv_aware's engine profile (name or JSON file) and knobs,
    conditional disaggregation's bound (tokens) and prefix warming's rule."""

    prefill_policy: str
    decode_policy: str
    inflight_timeout_s: float
    inflight_reservation_s: float
    seed: int | None
    kv_index: bool
    kv_stale_after_s: float
    kv_max_lag_events: int
    kv_events_interval_ms: int
    kv_index_max_blocks: int
    kv_profile: str
    kv_itl_weight: float
    kv_local_slack: float
    local_prefill_max_tokens: int
    kv_warm_min_tokens: int
    kv_warm_window_s: float
    kv_warm_requests_per_holder: int
    peers: str
    peer_lag_ms: float
    replica_id: str | None

    def peer_list(self) -> list[str]: ...


class PortSettings(PolicyFlags, Protocol):
    """The settings `open_scheduler` reads (`pdplane.gateway.settings.GatewaySettings` is one).

    `scheduler` is "host:port" of a `pdplane scheduler`, or `EMBEDDED`; `token`/`tls_ca`
    authenticate and verify it; `schedule_timeout_s` bounds one call and `release_batch_s` how
    long a queued Release waits for a Schedule to ride on (seconds); `schedule_stream` False
    makes a remote scheduler's Schedules unary calls. The policy flags configure the local
    implementation only (a remote scheduler has its own).
    """

    scheduler: str
    host: str
    inflight_port: int
    token: str | None
    tls_ca: str | None
    schedule_timeout_s: float
    schedule_stream: bool
    release_batch_s: float
