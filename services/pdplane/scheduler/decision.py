"""The scheduling decision: filter, pair, apply the prefill and decode policies, count in flight.

Plain Python (no gRPC): it takes the port's `RequestFeatures` and answers its `Decision`; the
servicer translates protobuf (`pdplane.scheduler.wire`) and errors to status codes, the local
scheduler (`pdplane.scheduler.local`) awaits nothing; unit tests and the benchmark call this
class directly.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from pdplane.core.grpc.echo import echo
from pdplane.scheduler.candidate import Candidate, PairKey
from pdplane.scheduler.compat import blocks_for, describe_keys, split_sides
from pdplane.scheduler.compat import warm_up as warm_up_filter
from pdplane.scheduler.errors import InvalidRequest, NoInstance, NoRoom
from pdplane.scheduler.inflight import InflightTracker
from pdplane.scheduler.latency import DEFAULT_PROFILE, LatencyModel
from pdplane.scheduler.metrics import SchedulerMetrics
from pdplane.scheduler.policies import POLICIES, PickContext, Policy, Pool, kv_aware, make_policy
from pdplane.scheduler.policies.base import warm_up as warm_up_pool
from pdplane.scheduler.port import Decision, Outcome, RequestFeatures, WarmHint
from pdplane.scheduler.table import (
    BLOCK_SIZE,
    BUSY_UNTIL,
    KV_SLOT,
    PAIR,
    REQUESTS,
    SERVING,
    UNSEEN,
    ModelTables,
    SideTable,
)
from pdplane.scheduler.view import CandidateView
from pdplane.scheduler.warming import PrefixWarmer, WarmSettings

if TYPE_CHECKING:
    from pdplane.scheduler.kv_index import PrefixIndex

__all__ = ["Decider"]

_MAX_ID_LEN = 1024  # characters; bounds what one in-flight entry may hold
_NO_LIVE = np.zeros(0, np.uint8)

F64s = npt.NDArray[np.float64]


class Decider:
    """Picks (prefill, decode) pairs over a live `CandidateView` and tracks them in flight.

    Policies are kept per side and per name, so round-robin counters and random generators of
    the prefill side never interfere with the decode side. `seed` seeds randomised policies,
    `kv_weights` the `kv_aware` cost.

    `kv_aware` predicts latencies with `kv_profile` (a `LatencyModel`, or a profile name or
    JSON file for one; None: the default profile). Conditional disaggregation: when the decode
    policy says so (`Pick.skip_prefill`: `kv_aware`, for a decode LIVE in the prefix index
    that holds at least one block of the prompt and all but at most
    `local_prefill_max_tokens` of it, 0 = never), the decision has no prefill: decode computes
    the rest itself.
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
        kv_weights: kv_aware.KvAwareWeights | None = None,
        local_prefill_max_tokens: int = 0,
        kv_profile: LatencyModel | str | None = None,
        warm: WarmSettings | None = None,
    ) -> None:
        if local_prefill_max_tokens < 0:
            raise ValueError("local_prefill_max_tokens must be >= 0")
        for name in (prefill_policy, decode_policy):
            if name not in POLICIES:
                raise ValueError(f"unknown policy {echo(name)}; known: {', '.join(POLICIES)}")
        self.view = view
        # Not `inflight or ...`: an empty tracker is falsy (it has __len__).
        self.inflight = inflight if inflight is not None else InflightTracker()
        self.metrics = metrics
        self._defaults = {"prefill": prefill_policy, "decode": decode_policy}
        self._seed = seed
        if isinstance(kv_profile, LatencyModel):
            model = kv_profile
        else:
            model = LatencyModel(kv_profile or DEFAULT_PROFILE)
        #: What kv_aware predicts latencies with.
        self.latency = model
        self._options: dict[str, dict[str, object]] = {
            kv_aware.NAME: {
                "weights": kv_weights or kv_aware.KvAwareWeights(),
                "model": model,
                "local_max_tokens": local_prefill_max_tokens,
            }
        }
        self.local_prefill_max_tokens = local_prefill_max_tokens
        #: Prefix warming (`pdplane.scheduler.warming`); off without a prefix index.
        self.warmer = PrefixWarmer(warm or WarmSettings(min_tokens=0))
        self._policies: dict[tuple[str, str], Policy] = {}
        #: The prefix index of the instances' KV caches (set by the wiring when enabled).
        self.kv_index: PrefixIndex | None = None
        # The kernels compile (or load from numba's cache) now, not on the first request.
        warm_up_filter()
        warm_up_pool()
        # A peer's assignment moves its prefill's predicted queue as an own one does.
        self.inflight.prefill_seconds = model.busy_s
        self._policy("prefill", "")
        self._policy("decode", "")

    def _policy(self, side: str, requested: str) -> Policy:
        name = requested or self._defaults[side]
        policy = self._policies.get((side, name))
        if policy is None:
            if name not in POLICIES:
                raise InvalidRequest(
                    f"{side}_policy: unknown policy {echo(name)}; known: {', '.join(POLICIES)}"
                )
            policy = self._policies[(side, name)] = make_policy(
                name, seed=self._seed, **self._options.get(name, {})
            )
        return policy

    def load(self, candidate: Candidate) -> float:
        """Effective load: reported running + waiting, plus own assignments since that report,
        plus KV cache usage (0..1) so that equal request counts prefer the emptier cache."""
        return self.inflight.effective_load(candidate)

    def schedule(self, request: RequestFeatures) -> Decision:
        """Chooses and counts a pair for `request`; the decision's sides are `Candidate`s.

        Re-scheduling an id that is still in flight replaces its earlier assignment (a retry).
        Raises InvalidRequest (bad field, unknown policy) or NoInstance (side "prefill",
        "decode" or "pair"; its NoRoom kind when instances are only full) with a message
        naming what is missing.
        """
        started = time.perf_counter()
        try:
            decision = self._decide(request)
        except NoRoom as exc:
            if self.metrics:
                self.metrics.no_room(exc.side)
            raise
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
        self.inflight.age()  # unreleased assignments reserve KV room for a bounded time only
        index = self.kv_index
        tables = self.view.tables(model, self.inflight, index)
        prefill_side, decode_side = split_sides(
            tables,
            tokens=tokens,
            exclude=request.exclude_instance_ids,
            push_tokens=request.prompt_tokens,
        )
        prefills = prefill_side.require(model, self.view.models)
        decodes = decode_side.require(model, self.view.models)
        assert tables is not None  # both sides have rows
        prefill_table, decode_table = tables.prefill, tables.decode
        pairable = prefills
        if not tables.uniform:
            decode_codes = decode_table.cols[decodes, PAIR]
            pairable = prefills[np.isin(prefill_table.cols[prefills, PAIR], decode_codes)]
            if not len(pairable):
                raise NoInstance(
                    "pair",
                    f"no compatible prefill/decode pair for model {echo(model)}: prefill "
                    f"[{describe_keys(_keys(tables, prefill_table, prefills))}] vs decode "
                    f"[{describe_keys(_keys(tables, decode_table, decodes))}] "
                    "(layout/transport/max_model_len differ)",
                )
        cached, per_block = self._cached(request)
        live = index.live_slots if index is not None else _NO_LIVE
        features = (
            request.request_id,
            request.routing_key,
            request.prefix_block_hashes
            if len(request.prefix_block_hashes)
            else _smallest_block_hashes(request.prefix_hashes),
            request.prefix_hashes,
            request.prompt_tokens,
        )
        now = self.inflight.now()
        prefill = prefill_policy.pick(
            Pool(prefill_table, pairable, cached, live, per_block),
            PickContext(*features, "prefill", request.max_tokens, now),
        )
        p = prefill.candidate
        matching = decodes
        if not tables.uniform:
            code = prefill_table.cols[prefill_table.row_of[p.instance_id], PAIR]
            matching = decodes[decode_table.cols[decodes, PAIR] == code]
        if p.can_decode:
            # A BOTH instance may serve both halves, but only when no other decode fits.
            own = decode_table.row_of.get(p.instance_id)
            others = matching[matching != own] if own is not None else matching
            matching = others if len(others) else matching
        decode = decode_policy.pick(
            Pool(decode_table, matching, cached, live, per_block),
            PickContext(
                *features,
                "decode",
                request.max_tokens,
                now,
                prefill.predicted_ms,
                request.first_token_from_prefill,
            ),
        )
        d = decode.candidate
        blocks = blocks_for(tokens, d.block_size)
        d_cached = decode.cached_tokens
        rest = request.prompt_tokens - d_cached
        # What the request attends over on decode, averaged over its answer.
        context = request.prompt_tokens + request.max_tokens // 2
        if decode.skip_prefill and d_cached > 0 and rest <= self.local_prefill_max_tokens:
            self.inflight.add(request.request_id, None, d, blocks, decode_context=context)
            if self.metrics:
                self.metrics.prefill_skipped(d.instance_id, d_cached)
            return Decision(
                None,
                d,
                f"no prefill: decode holds {d_cached}/{request.prompt_tokens} tokens, computes "
                f"{rest} itself; decode {decode.reason}",
                0,
                d_cached,
            )
        p_cached = prefill.cached_tokens
        self.inflight.add(
            request.request_id,
            p,
            d,
            blocks,
            max(request.prompt_tokens - p_cached, 0),
            prefill.queue_s,
            context,
        )
        if self.metrics and p_cached:
            self.metrics.predicted_hit(p.instance_id, p_cached)
        warm = None
        if (
            self.warmer.enabled
            and p_cached >= self.warmer.settings.min_tokens
            and prefill_policy.name == kv_aware.NAME
        ):
            warm = self._warm(request, prefill_table, pairable, cached, per_block, p, p_cached, now)
        return Decision(
            p, d, f"prefill {prefill.reason}; decode {decode.reason}", p_cached, d_cached, warm
        )

    def _warm(
        self,
        request: RequestFeatures,
        table: SideTable,
        rows: npt.NDArray[np.int64],
        cached: F64s | None,
        per_block: bool,
        chosen: Candidate,
        chosen_cached: int,
        now: float,
    ) -> WarmHint | None:
        """A warm of the prompt's prefix that `chosen` holds (`chosen_cached` tokens) onto an
        idle prefill of `rows` that does not, when that prefix is read often enough
        (`pdplane.scheduler.warming`)."""
        bs = chosen.block_size
        hashes = request.prefix_hashes.get(bs)
        index = self.kv_index
        if cached is None or index is None or hashes is None or bs <= 0:
            return None
        prefix_tokens = min(chosen_cached, len(hashes) * bs) // bs * bs
        warmer = self.warmer
        if prefix_tokens < warmer.settings.min_tokens:
            return None
        prefix = int(hashes[prefix_tokens // bs - 1])
        reads = warmer.read(prefix, now)
        # Most decisions stop here, before any pass over the side: a prefix read fewer times
        # than one holder's share, or one being warmed already.
        if not warmer.wanted(reads, 1) or warmer.busy(prefix, now):
            return None
        cols = table.cols
        slots = cols[rows, KV_SLOT].astype(np.int64)
        ok = (slots >= 0) & (slots < len(cached))
        hits = np.where(ok, cached[np.where(ok, slots, 0)], 0.0)
        if per_block:
            hits = hits * cols[rows, BLOCK_SIZE]
        holders = hits >= prefix_tokens
        if not warmer.wanted(reads, int(holders.sum())):
            warmer.nothing_to_do(prefix, now)
            return None
        live = index.live_slots
        idle = (
            ~holders
            & ok
            & (cols[rows, SERVING] == 1)
            & (cols[rows, REQUESTS] == 0)
            & (cols[rows, UNSEEN] == 0)
            & (cols[rows, BUSY_UNTIL] <= now)
        )
        # LIVE in the index, so its KV events will show the copy (one gather, no Python loop).
        known = (slots >= 0) & (slots < len(live))
        idle &= known
        if idle.any():
            idle[idle] = live[slots[idle]] != 0
        if not idle.any():
            warmer.nothing_to_do(prefix, now)
            return None
        target = table.candidates[int(rows[int(np.argmax(idle))])]
        done = self.inflight.queue_prefill(
            target.instance_id, self.latency.idle_s(prefix_tokens, 0)
        )
        # Until its KV events can have said it holds the copy, the same prefix is not
        # warmed again (the index learns of it within ~10 ms, --kv-events-interval-ms).
        warmer.started(prefix, done)
        if self.metrics:
            self.metrics.prefix_warmed(target.instance_id, prefix_tokens)
        return WarmHint(target, prefix_tokens)

    def _cached(self, request: RequestFeatures) -> tuple[F64s | None, bool]:
        """The prompt's predicted prefix hits per prefix index slot (tokens, or blocks when the
        request's hashes say no block size: then times each instance's own; None: no
        instance holds any), from one lookup per block size the request has hashes for (a
        hash chain of one block size never matches another's). The lookup writes only the
        LIVE instances that hold a prefix (`PrefixIndex.match_slots`)."""
        index = self.kv_index
        if index is None or not (request.prefix_hashes or len(request.prefix_block_hashes)):
            return None, False
        cached = np.zeros(len(index.live_slots))
        held = False
        if request.prefix_hashes:
            for block_size, hashes in request.prefix_hashes.items():
                held = index.match_slots(hashes, cached, block_size) or held
            return (cached if held else None), False
        held = index.match_slots(request.prefix_block_hashes, cached)
        return (cached if held else None), True

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


def _keys(tables: ModelTables, table: SideTable, rows: npt.NDArray[np.int64]) -> set[PairKey]:
    return {tables.pair_keys[int(code)] for code in table.cols[rows, PAIR]}


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
    for block_size, hashes in request.prefix_hashes.items():
        if block_size <= 0:
            raise InvalidRequest(f"prefix_hashes: block_size must be > 0, got {block_size}")
        if len(hashes) * block_size > request.prompt_tokens:
            raise InvalidRequest(
                f"prefix_hashes: {len(hashes)} blocks of {block_size} tokens exceed "
                f"prompt_tokens={request.prompt_tokens}"
            )


def _smallest_block_hashes(prefix_hashes: Mapping[int, Sequence[int]]) -> Sequence[int]:
    # One deterministic choice, so consistent_hash keys a prompt the same on every replica.
    return prefix_hashes[min(prefix_hashes)] if prefix_hashes else ()
