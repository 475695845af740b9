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
from collections.abc import Callable
from dataclasses import dataclass

import numba
import numpy as np
import numpy.typing as npt

from pdplane.scheduler.policies.base import Pick, PickContext, Pool
from pdplane.scheduler.table import BLOCK_SIZE, KV_SLOT, QUEUED_TOKENS, REQUESTS, UNSEEN, USAGE

__all__ = ["LOCAL_PREFILL_MAX_TOKENS", "NAME", "KvAware", "KvAwareWeights", "create"]

NAME = "kv_aware"

F64s = npt.NDArray[np.float64]
I64s = npt.NDArray[np.int64]
U8s = npt.NDArray[np.uint8]

_NO_HITS = np.zeros(0)

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
    """Lowest cost among the candidates within the load bound; equal costs taken in turn.

    The cost of every candidate is computed in one compiled pass over the pool's columns;
    the prefix hits come in as the pool's `cached` column (zeros except the few holders the
    KV lookup returned).
    """

    name = NAME

    def __init__(self, weights: KvAwareWeights) -> None:
        self.weights = weights
        self._turn = itertools.count()
        w = weights
        # The kernel's weights per side: hit weight, request tokens, KV usage tokens, c.
        self._prefill = np.array([1.0, w.request_tokens, w.kv_usage_tokens, w.load_factor])
        self._decode = np.array(
            [w.decode_hit_weight, w.request_tokens, w.kv_usage_tokens, w.load_factor]
        )
        one = np.zeros(1, np.int64)
        _score(
            np.zeros((1, 17)),
            one,
            _NO_HITS,
            False,
            np.zeros(0, np.uint8),
            1,
            True,
            self._prefill,
            0,
        )

    def pick(self, pool: Pool, ctx: PickContext) -> Pick:
        prefill = ctx.side == "prefill"
        cached = pool.cached if pool.cached is not None else _NO_HITS
        i, cost, requests, cap, skipped, live, cached_tokens = _score(
            pool.cols,
            pool.rows,
            cached,
            pool.cached_per_block,
            pool.live_slots,
            ctx.prompt_tokens,
            prefill,
            self._prefill if prefill else self._decode,
            next(self._turn),
        )
        n = len(pool)
        bound = f", {skipped} over load cap {cap}" if skipped else ""
        if not live:
            return pool.pick(i, f"{NAME}: no live KV index, load={requests:.0f} of {n}{bound}")
        return pool.pick(
            i,
            f"{NAME}: cached={cached_tokens}/{ctx.prompt_tokens} tokens, cost={cost:.0f} "
            f"of {n} ({live} live){bound}",
        )


def _compile(  # the columns are closure cells: part of numba's cache key
    requests_col: int = REQUESTS,
    unseen_col: int = UNSEEN,
    kv_slot_col: int = KV_SLOT,
    queued_col: int = QUEUED_TOKENS,
    usage_col: int = USAGE,
    block_size_col: int = BLOCK_SIZE,
) -> Callable[..., tuple[int, float, float, int, int, int, int]]:
    @numba.njit(cache=True, nogil=True)
    def score(
        cols: F64s,
        rows: I64s,
        cached: F64s,
        cached_per_block: bool,
        live_slots: U8s,
        prompt_tokens: int,
        with_queued: bool,
        weights: F64s,
        turn: int,
    ) -> tuple[int, float, float, int, int, int, int]:  # pragma: no cover - compiled
        """(position chosen, its cost, its requests, load cap, candidates over the cap, LIVE
        candidates, its cached tokens counted) over `rows` of `cols` (module doc); `weights`
        = (hit weight, request tokens, KV usage tokens, load factor)."""
        hit_weight, request_tokens, kv_usage_tokens = weights[0], weights[1], weights[2]
        load_factor = weights[3]
        n = rows.shape[0]
        requests = np.empty(n)
        total = 0.0
        live = 0
        slots = live_slots.shape[0]
        for i in range(n):  # first pass: requests (for the cap) and LIVE candidates
            row = rows[i]
            r = cols[row, requests_col] + cols[row, unseen_col]
            requests[i] = r if r > 0.0 else 0.0
            total += requests[i]
            slot = np.int64(cols[row, kv_slot_col])
            if 0 <= slot < slots and live_slots[slot]:
                live += 1
        cap = np.int64(math.ceil(load_factor * (total + 1.0) / n))
        fitting = 0
        for i in range(n):
            if requests[i] + 1.0 <= cap:
                fitting += 1
        best = np.inf
        ties = 0
        tied = np.empty(n, np.int64)  # positions of the lowest cost so far, in order
        hits = np.zeros(n)
        for i in range(n):
            if fitting and requests[i] + 1.0 > cap:
                continue
            row = rows[i]
            hit = 0.0
            slot = np.int64(cols[row, kv_slot_col])
            if live and 0 <= slot < cached.shape[0]:
                # The lookup's value for the row's index slot, capped at the prompt.
                hit = cached[slot] * (cols[row, block_size_col] if cached_per_block else 1.0)
                hit = min(hit, prompt_tokens)
            hits[i] = hit
            cost = (
                hit_weight * (prompt_tokens - hit)
                + (cols[row, queued_col] if with_queued else 0.0)
                + request_tokens * requests[i]
                + kv_usage_tokens * cols[row, usage_col]
            )
            if cost < best:
                best = cost
                ties = 0
            if cost == best:
                tied[ties] = i
                ties += 1
        chosen = tied[turn % ties]
        hit = hits[chosen]
        skipped = n - fitting if fitting else 0
        return chosen, best, float(requests[chosen]), int(cap), skipped, live, int(hit)

    return score  # type: ignore[no-any-return]


_score = _compile()
