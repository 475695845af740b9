"""kv_aware: the cheapest instance for this prompt, from what its KV cache already holds.

Cost of a candidate, in prompt-token equivalents (lower is better)::

    cost = hit_weight * uncached + queued + request_tokens * requests + kv_usage_tokens * usage

* `uncached` = prompt tokens - the predicted prefix cache hit on that instance (the prefix
  index, `PickContext.cached_tokens`, whole KV cache blocks). On prefill it is the prefill
  work; on decode it is what the connector must pull (it pulls only the blocks beyond
  decode's own prefix hits), so `hit_weight` is 1 on prefill and `decode_hit_weight` on decode.
* `queued` = uncached prompt tokens this scheduler sent the instance since its last load
  report (prefill only; `PickContext.queued_prefill_tokens`).
* `requests` = running + waiting requests (reported) plus own unreleased assignments since
  that report; `usage` = reported KV cache usage (0..1).

The shape is Dynamo's KV router cost (`overlap_score_weight * potential prefill blocks +
potential active blocks`, default weight 1.0, docs.nvidia.com/dynamo "Router Design"): new
prefill work plus the load already on the worker, in the same unit. pdplane counts the load
in requests (what the registry's load report carries) converted to tokens by
`request_tokens`, since a prefill instance's report does not say how long its queued prompts
are; all weights are settable (`KvAwareWeights`, flags `--kv-*` of the scheduler).

Bounded loads: a shared-prefix burst would otherwise all land on the one instance holding the
prefix (its uncached work is ~0), however long its queue. As in consistent hashing with
bounded loads (Mirrokni, Thorup, Zadimoghaddam, SODA 2018) a candidate whose requests would
exceed `ceil(load_factor * (total requests + 1) / candidates)` is skipped while any other
fits, so no instance takes more than `load_factor` times its fair share of a burst; the
scheduler's own in-flight accounting makes the burst visible between load reports.

Instances whose index entries are not LIVE (stale or syncing stream) count as holding
nothing: they compete by load only. With no LIVE candidate the policy is least-loaded (ties in
turn), so `kv_aware` is a safe default when KV events do not flow.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdplane.scheduler.candidate import Candidate
from pdplane.scheduler.policies.base import Pick, PickContext

__all__ = ["LOCAL_PREFILL_MAX_TOKENS", "NAME", "KvAware", "KvAwareWeights", "create"]

NAME = "kv_aware"

#: Default of --local-prefill-max-tokens (conditional disaggregation): under both the break-even
#: of a prefill leg's fixed cost and the ITL bound of the CPU cost model fitted to real vLLM
#: (docs/scheduler.md, "Why 256").
LOCAL_PREFILL_MAX_TOKENS = 256


@dataclass(frozen=True, slots=True)
class KvAwareWeights:
    """The cost's weights (module doc); token equivalents unless said otherwise.

    Attributes:
        request_tokens: one running, waiting or pending request (> 0 spreads load).
        kv_usage_tokens: a full KV cache (usage 1.0): a fuller cache evicts sooner.
        decode_hit_weight: on decode, one uncached token to pull, relative to one to compute
            on prefill (0..1: a pull is cheaper than a prefill, but not free).
        load_factor: bounded loads' c (>= 1); how far above the mean a holder may be loaded.
    """

    request_tokens: float = 512.0
    kv_usage_tokens: float = 1024.0
    decode_hit_weight: float = 0.25
    load_factor: float = 2.0

    def __post_init__(self) -> None:
        if self.request_tokens < 0 or self.kv_usage_tokens < 0 or self.decode_hit_weight < 0:
            raise ValueError("kv_aware weights must be >= 0")
        if self.load_factor < 1:
            raise ValueError(f"kv_aware load_factor must be >= 1, got {self.load_factor}")


def create(*, seed: int | None = None, weights: KvAwareWeights | None = None) -> KvAware:
    """A kv_aware policy with `weights` (default `KvAwareWeights()`); `seed` is ignored."""
    return KvAware(weights or KvAwareWeights())


class KvAware:
    """Lowest cost among the candidates within the load bound; equal costs taken in turn."""

    name = NAME

    def __init__(self, weights: KvAwareWeights) -> None:
        self.weights = weights
        self._turn = itertools.count()

    def pick(self, candidates: Sequence[Candidate], ctx: PickContext) -> Pick:
        w = self.weights
        hit_weight = 1.0 if ctx.side == "prefill" else w.decode_hit_weight
        requests = [max(ctx.load(c) - c.kv_cache_usage, 0.0) for c in candidates]
        cap = math.ceil(w.load_factor * (sum(requests) + 1) / len(candidates))
        fits = [i for i, r in enumerate(requests) if r + 1 <= cap] or range(len(candidates))
        live = sum(1 for c in candidates if ctx.kv_live(c))
        best: list[int] = []
        best_cost = math.inf
        cached_of: dict[int, int] = {}
        for i in fits:
            c = candidates[i]
            cached = cached_of[i] = (
                min(ctx.cached_tokens(c), ctx.prompt_tokens) if live and ctx.kv_live(c) else 0
            )
            cost = (
                hit_weight * (ctx.prompt_tokens - cached)
                + ctx.queued_prefill_tokens(c)
                + w.request_tokens * requests[i]
                + w.kv_usage_tokens * c.kv_cache_usage
            )
            if cost < best_cost:
                best, best_cost = [i], cost
            elif cost == best_cost:
                best.append(i)
        chosen = best[next(self._turn) % len(best)]
        skipped = len(candidates) - len(fits)
        bound = f", {skipped} over load cap {cap}" if skipped else ""
        if not live:
            return Pick(
                candidates[chosen],
                f"{NAME}: no live KV index, load={requests[chosen]:.0f} of "
                f"{len(candidates)}{bound}",
            )
        return Pick(
            candidates[chosen],
            f"{NAME}: cached={cached_of[chosen]}/{ctx.prompt_tokens} tokens, cost={best_cost:.0f} "
            f"of {len(candidates)} ({live} live){bound}",
        )
