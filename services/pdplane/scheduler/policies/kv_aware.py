"""kv_aware: the instance predicted fastest for this prompt, from what its KV cache holds.

Each candidate is scored by the latency it predicts from an engine profile's step-time model
(`pdplane.scheduler.latency`; a built-in profile name or a `pdplane profile` fit):

* prefill: the time until the prompt's KV is computed there = its queue (when the prompts the
  scheduler sent it are predicted done, `InflightTracker.busy_until`, corrected by its load
  reports) + a step of the prompt tokens it does not hold (the prefix index's predicted hit);
* decode, given that prefill: the pull of the tokens it does not hold and admission, or (when
  it holds a prefix of the prompt) computing the rest itself in its next step, if that lengthens
  the step its running streams would have had by at most `local_slack` (conditional
  disaggregation; at most `local_max_tokens` tokens); plus `itl_weight` x its step time with
  this request added (the request's ITL there, and its streams').

The lowest wins, equal predictions taken in turn. Instances not LIVE in the prefix index count
as holding nothing: with no LIVE instance the choice is by predicted queue (prefill) and step
time (decode) alone, so kv_aware is a safe default when KV events do not flow.

Source of the approach: llm-d's predicted-latency scheduler scores endpoints by TTFT and TPOT
predicted from their state (a learned model there; the simulator's calibrated cost model here).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from pdplane.scheduler.latency import LatencyModel, score_decode, score_prefill
from pdplane.scheduler.latency import warm_up as warm_up_kernels
from pdplane.scheduler.policies.base import Pick, PickContext, Pool

__all__ = [
    "ITL_WEIGHT",
    "LOCAL_PREFILL_MAX_TOKENS",
    "LOCAL_SLACK",
    "NAME",
    "KvAware",
    "KvAwareWeights",
    "create",
]

NAME = "kv_aware"

_NO_HITS = np.zeros(0)

#: Default of --local-prefill-max-tokens: the most prompt tokens a decode computes itself
#: (the latency model decides below it; 0 = always disaggregate).
LOCAL_PREFILL_MAX_TOKENS = 2048
#: Defaults of `KvAwareWeights` (--kv-itl-weight, --kv-local-slack).
ITL_WEIGHT = 10.0
LOCAL_SLACK = 0.02


@dataclass(frozen=True, slots=True)
class KvAwareWeights:
    """The policy's knobs (docs/scheduler.md says how they were chosen).

    Attributes:
        itl_weight: on decode, ms of predicted TTFT one ms of the decode's predicted step time
            (the request's ITL and its streams') is worth.
        local_slack: a decode computes a prompt's rest itself only if its step grows by at most
            this fraction of the step its running streams would have had.
    """

    itl_weight: float = ITL_WEIGHT
    local_slack: float = LOCAL_SLACK

    def __post_init__(self) -> None:
        if self.itl_weight < 0 or self.local_slack < 0:
            raise ValueError("kv_aware weights must be >= 0")


def create(
    *,
    seed: int | None = None,
    weights: KvAwareWeights | None = None,
    model: LatencyModel | None = None,
    local_max_tokens: int = LOCAL_PREFILL_MAX_TOKENS,
) -> KvAware:
    """A kv_aware policy with `weights` (default `KvAwareWeights()`) predicting with `model`
    (default: `LatencyModel()`, the default profile); a decode computes at most
    `local_max_tokens` of a prompt itself (0 = never); `seed` is ignored."""
    return KvAware(weights or KvAwareWeights(), model or LatencyModel(), local_max_tokens)


class KvAware:
    """Lowest predicted latency (module doc), one compiled pass over the pool's columns."""

    name = NAME

    def __init__(self, weights: KvAwareWeights, model: LatencyModel, local_max_tokens: int) -> None:
        if local_max_tokens < 0:
            raise ValueError("local_max_tokens must be >= 0")
        self.weights = weights
        self.model = model
        self.local_max_tokens = local_max_tokens
        self._turn = itertools.count()
        warm_up_kernels()

    def pick(self, pool: Pool, ctx: PickContext) -> Pick:
        cached = pool.cached if pool.cached is not None else _NO_HITS
        k = self.model.coefficients
        n = len(pool)
        if ctx.side == "prefill":
            i, ttft, wait, hit, live = score_prefill(
                pool.cols,
                pool.rows,
                cached,
                pool.cached_per_block,
                pool.live_slots,
                ctx.prompt_tokens,
                k,
                ctx.now,
                next(self._turn),
            )
            return Pick(
                pool.candidate(i),
                f"{NAME}: cached={hit}/{ctx.prompt_tokens} tokens, KV in {ttft:.0f} ms "
                f"(queue {wait:.0f}) of {n} ({live} live)",
                pool.cached_tokens(i),
                ttft,
                self.model.busy_s(ctx.prompt_tokens - hit, hit, wait * 1e-3),
            )
        w = self.weights
        i, score, ttft, hit, local, live = score_decode(
            pool.cols,
            pool.rows,
            cached,
            pool.cached_per_block,
            pool.live_slots,
            ctx.prompt_tokens,
            ctx.max_tokens,
            k,
            ctx.prefill_ms,
            self.local_max_tokens,
            w.local_slack,
            w.itl_weight,
            ctx.first_from_prefill,
            next(self._turn),
        )
        how = "computes the rest" if local else "pulls"
        return Pick(
            pool.candidate(i),
            f"{NAME}: cached={hit}/{ctx.prompt_tokens} tokens, {how}, first token in "
            f"{ttft:.0f} ms, score {score:.0f} of {n} ({live} live)",
            pool.cached_tokens(i),
            ttft,
            skip_prefill=bool(local),
        )
