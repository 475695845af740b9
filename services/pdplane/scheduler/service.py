"""The scheduling decision: filter, pair, apply the prefill and decode policies, count in flight.

Plain Python (no gRPC): it takes the port's `RequestFeatures` and answers its `Decision`; the
servicer translates protobuf (`pdplane.scheduler.wire`) and errors to status codes, the local
scheduler (`pdplane.scheduler.local`) awaits nothing; unit tests and the benchmark call this
class directly.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pdplane.scheduler.candidate import Candidate
from pdplane.scheduler.compat import blocks_for, describe_keys, pair_keys_of, split_sides
from pdplane.scheduler.errors import InvalidRequest, NoInstance
from pdplane.scheduler.inflight import InflightTracker
from pdplane.scheduler.metrics import SchedulerMetrics
from pdplane.scheduler.policies import POLICIES, PickContext, Policy, make_policy
from pdplane.scheduler.port import Decision, Outcome, RequestFeatures
from pdplane.scheduler.view import CandidateView

if TYPE_CHECKING:
    from pdplane.scheduler.kv_index import PrefixIndex

__all__ = ["SchedulerService"]

_MAX_ID_LEN = 1024  # characters; bounds what one in-flight entry may hold


class SchedulerService:
    """Picks (prefill, decode) pairs over a live `CandidateView` and tracks them in flight.

    Policies are kept per side and per name, so round-robin counters and random generators of
    the prefill side never interfere with the decode side. `seed` seeds randomised policies.
    """

    def __init__(
        self,
        view: CandidateView,
        *,
        prefill_policy: str = "least_loaded",
        decode_policy: str = "least_loaded",
        inflight: InflightTracker | None = None,
        metrics: SchedulerMetrics | None = None,
        seed: int | None = None,
    ) -> None:
        for name in (prefill_policy, decode_policy):
            if name not in POLICIES:
                raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
        self.view = view
        # Not `inflight or ...`: an empty tracker is falsy (it has __len__).
        self.inflight = inflight if inflight is not None else InflightTracker()
        self.metrics = metrics
        self._defaults = {"prefill": prefill_policy, "decode": decode_policy}
        self._seed = seed
        self._policies: dict[tuple[str, str], Policy] = {}
        #: The prefix index of the instances' KV caches (set by the wiring when enabled).
        self.kv_index: PrefixIndex | None = None

    def _policy(self, side: str, requested: str) -> Policy:
        name = requested or self._defaults[side]
        policy = self._policies.get((side, name))
        if policy is None:
            if name not in POLICIES:
                raise InvalidRequest(
                    f"{side}_policy: unknown policy {name!r}; known: {', '.join(POLICIES)}"
                )
            policy = self._policies[(side, name)] = make_policy(name, seed=self._seed)
        return policy

    def load(self, candidate: Candidate) -> float:
        """Effective load: reported running + waiting, plus own assignments since that report,
        plus KV cache usage (0..1) so that equal request counts prefer the emptier cache."""
        return self.inflight.effective_load(candidate)

    def schedule(self, request: RequestFeatures) -> Decision:
        """Chooses and counts a pair for `request`; the decision's sides are `Candidate`s.

        Re-scheduling an id that is still in flight replaces its earlier assignment (a retry).
        Raises InvalidRequest (bad field, unknown policy) or NoInstance (side "prefill",
        "decode" or "pair") with a message naming what is missing.
        """
        started = time.perf_counter()
        try:
            decision = self._decide(request)
        except NoInstance as exc:
            if self.metrics:
                self.metrics.unavailable(exc.side)
            raise
        except InvalidRequest:
            if self.metrics:
                self.metrics.invalid()
            raise
        if self.metrics:
            self.metrics.decided(
                request.prefill_policy or self._defaults["prefill"],
                request.decode_policy or self._defaults["decode"],
                time.perf_counter() - started,
            )
        return decision

    def _decide(self, request: RequestFeatures) -> Decision:
        _validate(request)
        prefill_policy = self._policy("prefill", request.prefill_policy)
        decode_policy = self._policy("decode", request.decode_policy)
        tokens = request.prompt_tokens + request.max_tokens
        model = request.model
        prefill_side, decode_side = split_sides(
            self.view.candidates(model),
            tokens=tokens,
            exclude=request.exclude_instance_ids,
            pending_blocks=self.inflight.pending_blocks,
            push_tokens=request.prompt_tokens,
        )
        prefills = prefill_side.require(model, self.view.models)
        decodes = decode_side.require(model, self.view.models)
        # Usual fleet: one layout everywhere, nothing to pair up.
        uniform = self.view.is_uniform(model)
        pairable = prefills
        if not uniform:
            decode_keys = pair_keys_of(decodes)
            pairable = [p for p in prefills if p.pair_key in decode_keys]
        if not pairable:
            raise NoInstance(
                "pair",
                f"no compatible prefill/decode pair for model {model!r}: prefill "
                f"[{describe_keys(pair_keys_of(prefills))}] vs decode "
                f"[{describe_keys(decode_keys)}] (layout/transport/max_model_len differ)",
            )
        ctx = PickContext(
            request.request_id,
            request.routing_key,
            request.prefix_block_hashes,
            self.inflight.effective_load,
        )
        prefill = prefill_policy.pick(pairable, ctx)
        p = prefill.candidate
        matching = decodes if uniform else [d for d in decodes if d.pair_key == p.pair_key]
        if p.can_decode:
            # A BOTH instance may serve both halves, but only when no other decode fits.
            matching = [d for d in matching if d.instance_id != p.instance_id] or matching
        decode = decode_policy.pick(matching, ctx)
        d = decode.candidate
        self.inflight.add(request.request_id, p, d, blocks_for(tokens, d.block_size))
        return Decision(p, d, f"prefill {prefill.reason}; decode {decode.reason}")

    def release(self, request_id: str, outcome: Outcome) -> bool:
        """Ends the in-flight accounting of `request_id`; False when it was not in flight.

        `outcome` only feeds metrics.
        Raises InvalidRequest on an empty id.
        """
        if not request_id:
            raise InvalidRequest("request_id: must not be empty")
        released = self.inflight.release(request_id) is not None
        if self.metrics:
            self.metrics.released(outcome, released)
        return released


def _validate(request: RequestFeatures) -> None:
    if not request.request_id:
        raise InvalidRequest("request_id: must not be empty")
    if len(request.request_id) > _MAX_ID_LEN:
        raise InvalidRequest(f"request_id: longer than {_MAX_ID_LEN} characters")
    if not request.model:
        raise InvalidRequest("model: must not be empty")
    if request.prompt_tokens <= 0:
        raise InvalidRequest(f"prompt_tokens: must be > 0, got {request.prompt_tokens}")
    if request.max_tokens < 0:
        raise InvalidRequest(f"max_tokens: must be >= 0, got {request.max_tokens}")
