"""What `kv_aware` predicts latencies with: an engine profile's step-time model.

The profile (`pdplane.sim.profiles.Profile`: a built-in name, or the JSON `pdplane profile`
fits to a real engine) is the one the simulator runs on; its cost model gives the duration of
one engine step from the tokens, sequences and context it holds (the roofline-shaped formula
of `pdplane.sim.profiles`, after Vidur):

    step = step_ms + max(weights_ms, token_ms x T) + prefill_token_ms x P + seq_ms x S
           + kv_read_ms_per_ktok x C / 1000 + prefill_attn_ms_per_mpair x Q / 1e6

(T tokens computed, P of them prompt tokens, S sequences, C context tokens attended over, Q
prefill query-key pairs). `LatencyModel.coefficients` carries the profile's numbers as one
float64 array (order: `COEFFICIENTS`); the kernels here evaluate the formula per candidate in
one compiled pass over a side's table (`pdplane.scheduler.table`), for `kv_aware`:

* prefill (`score_prefill`): the predicted time until the prompt's KV is computed = max(the API
  server's time `request_ms`, the instance's queue BUSY_UNTIL - now) + a step of the uncached
  tokens after the cached ones (a prompt longer than the token budget takes several). What a
  prompt adds to the queue is `LatencyModel.busy_s`: reaching an idle engine (a queue no longer
  than the API time), until its own predicted KV (`idle_s`: the step's fixed part and weight
  reads are its own); meeting a queue, the parts of a step that grow with it (`queue_s`; the
  first prompt behind a running step starts a step of its own, so that one is under-predicted);
* decode (`score_decode`): after that prefill, the pull of the tokens decode does not hold
  (`transfer_latency_ms` + bytes / `transfer_gbps`) and admission (half a step to wait, one to
  recompute the last prompt token), or, when decode holds a prefix, computing the rest itself
  in its next step (conditional disaggregation) if that step grows by at most `slack` of the
  step its running streams would have had (any step when it runs none and only the prompt's
  partial last block is left) and that predicts the client's first token sooner (with the first
  token from prefill, docs/first-token.md, the prefill leg's first token is prefill's own);
  plus `itl_weight` x the step time its streams will see with this request added (its ITL, and
  theirs).
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np
import numpy.typing as npt

from pdplane.scheduler.table import (
    BLOCK_SIZE,
    BUSY_UNTIL,
    COLUMNS,
    CONTEXT,
    KV_SLOT,
    PENDING_BLOCKS,
    RELEASED,
    REQUESTS,
    TOTAL_BLOCKS,
    UNSEEN,
    USAGE,
)
from pdplane.sim.profiles import Profile, load_profile

__all__ = [
    "COEFFICIENTS",
    "DEFAULT_PROFILE",
    "LatencyModel",
    "score_decode",
    "score_prefill",
    "warm_up",
]

F64s = npt.NDArray[np.float64]
_DecodeScore = tuple[int, float, float, int, bool, int]
I64s = npt.NDArray[np.int64]
U8s = npt.NDArray[np.uint8]

#: The profile `kv_aware` predicts with when none is named (--kv-profile): Llama-3-8B on one
#: H100 (docs/scheduler.md says why a default and what it changes).
DEFAULT_PROFILE = "llama3-8b-h100"

#: Order of `LatencyModel.coefficients` (ms per unit named; bytes per token; GB/s; tokens).
COEFFICIENTS = (
    "step_ms",
    "weights_ms",
    "token_ms",
    "prefill_token_ms",
    "seq_ms",
    "kv_read_ms_per_ktok",
    "prefill_attn_ms_per_mpair",
    "request_ms",
    "transfer_latency_ms",
    "kv_bytes_per_token",
    "transfer_gbps",
    "max_num_batched_tokens",
)


class LatencyModel:
    """Step-time predictions of one engine profile (module doc).

    Raises ValueError (from `load_profile`) for an unknown name or a bad profile file.
    """

    __slots__ = ("coefficients", "profile")

    def __init__(self, profile: Profile | str = DEFAULT_PROFILE) -> None:
        self.profile = load_profile(profile) if isinstance(profile, str) else profile
        p = self.profile
        c = p.cost
        self.coefficients: F64s = np.array(
            [
                c.step_ms,
                c.weights_ms,
                c.token_ms,
                c.prefill_token_ms,
                c.seq_ms,
                c.kv_read_ms_per_ktok,
                c.prefill_attn_ms_per_mpair,
                c.request_ms + c.serial_request_ms,
                p.transfer_latency_ms,
                float(p.kv_bytes_per_token),
                p.transfer_gbps,
                float(p.max_num_batched_tokens),
            ]
        )

    @property
    def name(self) -> str:
        return self.profile.name

    def step_ms(self, seqs: float, context: float, new: float = 0.0, cached: float = 0.0) -> float:
        """One engine step (ms): `seqs` decoding sequences attending over `context` tokens in
        all, plus a prefill of `new` tokens after `cached` ones (0: none; more than the
        token budget: the steps it takes, summed)."""
        return float(_step(self.coefficients, seqs, context, new, cached))

    def queue_s(self, new: float, cached: float = 0.0) -> float:
        """What a prompt of `new` uncached tokens after `cached` ones adds to a busy prefill's
        queue (s): the parts of a step that grow with it (queued prompts share a step's fixed
        part and its weight reads)."""
        k = self.coefficients
        pairs = new * (cached + new / 2.0)
        return float((k[2] + k[3]) * new + k[4] + k[6] * pairs * 1e-6) * 1e-3

    def idle_s(self, new: float, cached: float = 0.0) -> float:
        """How long a prompt of `new` uncached tokens after `cached` ones keeps an idle prefill
        busy (s): the API server, then a step of its own (the step's fixed part and weight
        reads are all its own: nothing shares them). The same as `score_prefill`'s
        prediction with no queue."""
        k = self.coefficients
        return float(k[7] + _step(k, 0.0, 0.0, new, cached)) * 1e-3

    def busy_s(self, new: float, cached: float, wait_s: float) -> float:
        """How much later a prefill whose queue ends `wait_s` from now (s) is busy after a
        prompt of `new` uncached tokens after `cached` ones is sent there (s): its share of a
        step (`queue_s`) when the queue outlasts the API server's time (it joins queued
        prompts), else until its own predicted KV (`idle_s`: it reaches an idle engine).
        One rule for a replica's own decisions and its peers'."""
        if wait_s * 1e3 > self.coefficients[7]:
            return self.queue_s(new, cached)
        return self.idle_s(new, cached) - max(wait_s, 0.0)

    def transfer_ms(self, tokens: float) -> float:
        """A KV pull of `tokens` tokens between two instances (ms)."""
        return float(_transfer(self.coefficients, tokens))


@numba.njit(cache=True, nogil=True)
def _step(k: F64s, seqs: float, context: float, new: float, cached: float) -> float:
    """The cost model's step time (ms); a prefill longer than the token budget left by the
    decodes is spread over equal chunks, one step each (summed)."""
    budget = max(k[11] - seqs, 1.0)
    steps = max(1.0, np.ceil(new / budget)) if new > 0 else 1.0
    chunk = new / steps
    one = (
        k[0]
        + max(k[1], k[2] * (seqs + chunk))
        + k[3] * chunk
        + k[4] * (seqs + (1.0 if new > 0 else 0.0))
        + k[5] * context * 1e-3
        + k[6] * chunk * (cached + new / 2.0) * 1e-6
    )
    return steps * one  # type: ignore[no-any-return]


@numba.njit(cache=True, nogil=True)
def _transfer(k: F64s, tokens: float) -> float:
    if tokens <= 0:
        return 0.0
    gbps = k[10]
    return k[8] + (tokens * k[9] / (gbps * 1e9) * 1e3 if gbps > 0 else 0.0)  # type: ignore[no-any-return]


def _compile(  # the columns are closure cells: part of numba's cache key
    requests_col: int = REQUESTS,
    unseen_col: int = UNSEEN,
    kv_slot_col: int = KV_SLOT,
    usage_col: int = USAGE,
    block_size_col: int = BLOCK_SIZE,
    total_blocks_col: int = TOTAL_BLOCKS,
    pending_blocks_col: int = PENDING_BLOCKS,
    busy_col: int = BUSY_UNTIL,
    released_col: int = RELEASED,
    context_col: int = CONTEXT,
) -> tuple[
    Callable[..., tuple[int, float, float, int, int]],
    Callable[..., tuple[int, float, float, int, bool, int]],
]:
    @numba.njit(cache=True, nogil=True)
    def is_live(cols: F64s, row: int, live_slots: U8s) -> bool:  # pragma: no cover - compiled
        """Whether the row's instance is LIVE in the prefix index."""
        slot = np.int64(cols[row, kv_slot_col])
        return 0 <= slot < live_slots.shape[0] and live_slots[slot] != 0

    @numba.njit(cache=True, nogil=True)
    def hit_of(
        cols: F64s, row: int, cached: F64s, per_block: bool, live_slots: U8s, prompt: int
    ) -> float:  # pragma: no cover - compiled
        """Predicted prefix cache hit (tokens) of a LIVE row; an engine computes at least the
        prompt's last token."""
        slot = np.int64(cols[row, kv_slot_col])
        if slot >= cached.shape[0] or not is_live(cols, row, live_slots):
            return 0.0
        hit = cached[slot] * (cols[row, block_size_col] if per_block else 1.0)
        return min(hit, prompt - 1.0) if hit > 0 else 0.0

    @numba.njit(cache=True, nogil=True)
    def lowest(scores: F64s, turn: int) -> int:  # pragma: no cover - compiled
        """Position of the lowest score; equal lowest ones taken in turn."""
        best = scores.min()
        tied = np.flatnonzero(scores == best)
        return tied[turn % tied.shape[0]]  # type: ignore[no-any-return]

    @numba.njit(cache=True, nogil=True)
    def prefill(
        cols: F64s,
        rows: I64s,
        cached: F64s,
        per_block: bool,
        live_slots: U8s,
        prompt: int,
        k: F64s,
        now: float,
        turn: int,
    ) -> tuple[int, float, float, int, int]:  # pragma: no cover - compiled
        """(position chosen, its predicted time to KV (ms), its queue wait (ms), its cached
        tokens, LIVE candidates); equal predictions taken in turn."""
        n = rows.shape[0]
        scores = np.empty(n)
        waits = np.empty(n)
        hits = np.empty(n)
        live = 0
        for i in range(n):
            row = rows[i]
            live += is_live(cols, row, live_slots)
            hit = hit_of(cols, row, cached, per_block, live_slots, prompt)
            wait = max(cols[row, busy_col] - now, 0.0) * 1e3
            # The API server's time and the queue overlap: the engine takes the prompt when
            # both are over (busy_until is when the queued prompts' KV is computed).
            t = max(k[7], wait) + _step(k, 0.0, 0.0, prompt - hit, hit)
            scores[i] = t
            waits[i] = wait
            hits[i] = hit
        chosen = lowest(scores, turn)
        return chosen, scores[chosen], waits[chosen], int(hits[chosen]), live

    @numba.njit(cache=True, nogil=True)
    def decode(
        cols: F64s,
        rows: I64s,
        cached: F64s,
        per_block: bool,
        live_slots: U8s,
        prompt: int,
        max_tokens: int,
        k: F64s,
        prefill_ms: float,
        local_max: int,
        slack: float,
        itl_weight: float,
        first_from_prefill: bool,
        turn: int,
    ) -> tuple[int, float, float, int, bool, int]:  # pragma: no cover - compiled
        """(position chosen, its score (ms), its predicted time to first token (ms), its
        cached tokens, whether it computes the prompt itself, LIVE candidates). With
        `first_from_prefill` the client's first token of a prefill leg is prefill's, at
        `prefill_ms`: a decode computes the prompt itself only when its own first token is
        predicted sooner than that."""
        n = rows.shape[0]
        scores = np.empty(n)
        ttfts = np.empty(n)
        hits = np.empty(n)
        local = np.zeros(n, np.bool_)
        live = 0
        for i in range(n):
            row = rows[i]
            live += is_live(cols, row, live_slots)
            hit = hit_of(cols, row, cached, per_block, live_slots, prompt)
            seqs = cols[row, requests_col] - cols[row, released_col] + cols[row, unseen_col]
            seqs = max(seqs, 0.0)
            bs = cols[row, block_size_col]
            if cols[row, total_blocks_col] > 0:
                context = (
                    cols[row, usage_col] * cols[row, total_blocks_col]
                    + cols[row, pending_blocks_col]
                ) * bs
            else:  # no KV report: every sequence as long as this one
                context = seqs * (prompt + max_tokens / 2.0)
            # Each sequence attends over its whole context, a prefix it shares with others
            # too, which the KV usage counts once: at least the mean context of the requests
            # sent there per sequence.
            context = max(context, seqs * cols[row, context_col], 0.0)
            now_step = _step(k, seqs, context, 0.0, 0.0)
            after = _step(k, seqs + 1.0, context + prompt, 0.0, 0.0)
            ttft = prefill_ms + _transfer(k, prompt - hit) + k[7] + 1.5 * after
            # the client's first token over the prefill leg
            first = prefill_ms if first_from_prefill else ttft
            new = prompt - hit
            if local_max > 0 and hit >= bs and new <= local_max:
                with_local = _step(k, seqs, context, new, hit)
                # Holding every whole block of the prompt, an idle decode (it stalls no
                # stream) computes the partial last block itself rather than wait for a
                # prefill leg to compute and send it, when that predicts the earlier token.
                tail_only = seqs < 1.0 and new < bs
                if tail_only or with_local - now_step <= slack * now_step:
                    own = k[7] + 0.5 * now_step + with_local
                    if own < first:
                        ttft = own
                        local[i] = True
            scores[i] = ttft + itl_weight * after
            ttfts[i] = ttft
            hits[i] = hit
        chosen = lowest(scores, turn)
        return chosen, scores[chosen], ttfts[chosen], int(hits[chosen]), local[chosen], live

    return prefill, decode  # type: ignore[return-value]


score_prefill, score_decode = _compile()


def warm_up() -> None:
    """Compiles (or loads from numba's cache) the kernels now, not on a request."""
    k = LatencyModel().coefficients
    cols = np.zeros((1, COLUMNS))
    rows = np.zeros(1, np.int64)
    hits, live = np.zeros(1), np.ones(1, np.uint8)
    score_prefill(cols, rows, hits, False, live, 1, k, 0.0, 0)
    score_decode(cols, rows, hits, False, live, 1, 1, k, 0.0, 0, 0.0, 1.0, False, 0)
