"""The engine model: vLLM v1's scheduler loop over a simulated paged KV cache.

No clock and no I/O here: `schedule(now)` builds one step's batch, the caller lets the step's
modelled time pass (`Step.duration_ms`), then `complete(step, now)` applies it. The asyncio
runner (`pdplane.sim.runner`) sleeps for real; tests and the calibration drive a virtual clock.

What is modelled after vLLM v1 (`vllm/v1/core/sched/scheduler.py`), not copied:
- one token budget per step (`max_num_batched_tokens`) shared by decodes (one token each) and
  prefill chunks (chunked prefill: a long prompt is spread over steps);
- running requests are served first, in arrival order; a running request that needs a new KV
  block when none is free preempts the newest running request (its blocks are freed, it goes
  back to the front of the queue and later recomputes prompt + output so far, with whatever of
  its prefix the cache still holds), counted in `stats.preemptions`;
- waiting requests are admitted in order only in steps that preempted nothing, while fewer than
  `max_num_seqs` run and the head's blocks fit (first come, first served: the head blocks the
  rest); requests that already hold KV blocks (a finished remote load) go first;
- the prefix cache answers before anything is computed (at most all but the prompt's last
  token), and KV blocks are allocated as tokens are computed, not reserved up front;
- a remote prefill's KV (`remote_tokens`): the request gets blocks for its whole prompt, then
  waits for the load (vLLM's WAITING_FOR_REMOTE_KVS) without taking budget; after a load the
  last prompt token is recomputed (as vLLM does); a failed load recomputes the prompt here.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdplane.sim.kv_cache import NO_PARENT, BlockPool, chain_hashes
from pdplane.sim.profiles import CostModel
from pdplane.sim.stats import EngineStats

__all__ = ["EngineCore", "EngineLimits", "EngineRequest", "Phase", "Step"]


class Phase(enum.IntEnum):
    WAITING = 0  # queued (new or preempted)
    LOADING = 1  # blocks allocated, remote KV on its way
    READY = 2  # holds loaded KV, queued to run
    RUNNING = 3
    DONE = 4


class EngineRequest:
    """One request inside the engine (token ids, progress, blocks).

    Args:
        request_id: for logs and the caller's bookkeeping.
        prompt: prompt token ids.
        outputs: the token ids it will generate (len = max_tokens), used as the ids of its
            output blocks in the prefix cache.
        remote_tokens: prompt tokens a remote prefill computed (load them instead of
            computing; 0 = none).
        hold: keep the KV blocks when it finishes (a prefill for a remote decode); the caller
            frees them with `EngineCore.release`.
    """

    __slots__ = (
        "arrival",
        "blocks",
        "first_token_at",
        "first_token_step",
        "hold",
        "keys",
        "last_token_at",
        "local_hit",
        "max_tokens",
        "num_cached",
        "num_computed",
        "num_output",
        "outputs",
        "phase",
        "preemptions",
        "prompt",
        "queued_step",
        "remote_tokens",
        "request_id",
        "waiter",
    )

    def __init__(
        self,
        request_id: str,
        prompt: Sequence[int],
        outputs: Sequence[int],
        *,
        remote_tokens: int = 0,
        hold: bool = False,
    ) -> None:
        if not prompt or not outputs:
            raise ValueError("a request needs at least one prompt and one output token")
        self.request_id = request_id
        self.prompt = prompt
        self.outputs = outputs
        self.max_tokens = len(outputs)
        self.remote_tokens = remote_tokens
        self.hold = hold
        self.phase = Phase.WAITING
        self.num_computed = 0
        self.num_output = 0
        self.blocks: list[int] = []
        self.keys: list[int] = []
        self.num_cached = 0
        self.local_hit = 0
        self.arrival = 0.0
        self.first_token_at = -1.0
        #: engine steps completed when it was queued, and the number (from 1) of the step
        #: that sampled its first token (-1 until then): the engine's own clock, which a busy
        #: machine cannot skew (it only stretches steps)
        self.queued_step = -1
        self.first_token_step = -1
        self.last_token_at = 0.0
        self.preemptions = 0
        #: set by the runner: what to wake when this request makes progress
        self.waiter: object | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens known so far: prompt + generated."""
        return len(self.prompt) + self.num_output

    @property
    def finished(self) -> bool:
        return self.num_output >= self.max_tokens


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """vLLM's scheduler limits and the cache size (blocks of `block_size` tokens)."""

    num_blocks: int = 8192
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    prefix_caching: bool = True
    #: wake the request's waiter every this many tokens (and on the first and last)
    stream_interval: int = 1


@dataclass(slots=True)
class Step:
    """One step's batch and the numbers its cost depends on (see `CostModel`)."""

    batch: list[tuple[EngineRequest, int]] = field(default_factory=list)
    tokens: int = 0
    prefill_tokens: int = 0
    context: int = 0
    pairs: float = 0.0
    #: requests that got their blocks for a remote load in this step (the caller loads them)
    loads: list[EngineRequest] = field(default_factory=list)
    duration_ms: float = 0.0


class EngineCore:
    """The scheduler state of one simulated instance.

    `pool.sink` receives the KV cache events; `stats` counts what happened.
    """

    def __init__(self, limits: EngineLimits, cost: CostModel, pool: BlockPool | None = None):
        self.limits = limits
        self.cost = cost
        self.pool = pool or BlockPool(
            limits.num_blocks, limits.block_size, caching=limits.prefix_caching
        )
        self.stats = EngineStats()
        self.running: list[EngineRequest] = []
        self.waiting: deque[EngineRequest] = deque()
        self.ready: deque[EngineRequest] = deque()
        self.loading: set[EngineRequest] = set()

    # --- load ---------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Queued requests, including those waiting for or holding remote KV."""
        return len(self.waiting) + len(self.ready) + len(self.loading)

    @property
    def has_work(self) -> bool:
        """Whether a step could do anything now (loads in flight alone do not count)."""
        return bool(self.running or self.waiting or self.ready)

    # --- requests -------------------------------------------------------------------------
    def add(self, req: EngineRequest, now: float) -> None:
        """Queues a request. Raises ValueError when its prompt alone cannot fit the cache."""
        pool = self.pool
        if pool.blocks_for(len(req.prompt) + 1) > pool.num_blocks:
            raise ValueError(
                f"prompt of {len(req.prompt)} tokens exceeds the KV cache "
                f"({pool.num_blocks} blocks of {pool.block_size})"
            )
        req.arrival = now
        req.queued_step = self.stats.steps
        if pool.caching:
            req.keys = chain_hashes(req.prompt, pool.block_size)
        self.waiting.append(req)
        self.stats.prompt_tokens += len(req.prompt)
        self._sample(now)

    def abort(self, req: EngineRequest, now: float) -> None:
        """Removes a request wherever it is and frees its blocks (no-op once DONE)."""
        phase = req.phase
        if phase == Phase.DONE:
            return
        if phase == Phase.WAITING:
            if req not in self.waiting:  # never added (cancelled before it arrived)
                req.phase = Phase.DONE
                return
            self.waiting.remove(req)
        elif phase == Phase.LOADING:
            self.loading.discard(req)
        elif phase == Phase.READY:
            self.ready.remove(req)
        else:
            self.running.remove(req)
        self.pool.free(req.blocks)
        req.blocks = []
        req.phase = Phase.DONE
        self.stats.aborted += 1
        self._sample(now)

    def release(self, block_ids: Sequence[int]) -> None:
        """Frees blocks a finished `hold` request kept (its transfer ended)."""
        self.pool.free(block_ids)

    def load_done(self, req: EngineRequest, ok: bool, now: float) -> None:
        """A remote load ended: with `ok` the prompt's KV is here, else it is recomputed."""
        if req.phase != Phase.LOADING:
            return  # aborted meanwhile
        self.loading.discard(req)
        if ok:
            req.num_computed = len(req.prompt) - 1  # vLLM recomputes the last prompt token
            self._cache_full_blocks(req)
        else:
            req.num_computed = req.local_hit
            self.stats.kv_load_failures += 1
            self.stats.recomputed_prompts += 1
        req.phase = Phase.READY
        self.ready.append(req)

    # --- one step -------------------------------------------------------------------------
    def schedule(self, now: float) -> Step:
        """Builds the next step's batch (maybe empty); changes queues and blocks."""
        limits, pool = self.limits, self.pool
        step = Step()
        budget = limits.max_num_batched_tokens
        running = self.running
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            if n <= 0:
                i += 1
                continue
            need = pool.blocks_for(req.num_computed + n) - len(req.blocks)
            while need > pool.num_free:
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.phase != Phase.RUNNING:
                break  # it preempted itself: nothing else fits either
            if need > 0:
                req.blocks.extend(pool.allocate(need))
            self._add_to_batch(step, req, n)
            budget -= n
            i += 1
        if not preempted:
            budget = self._admit(step, budget, now)
        step.duration_ms = self.cost.step_time_ms(
            step.tokens, step.prefill_tokens, len(step.batch), step.context, step.pairs
        )
        return step

    def _admit(self, step: Step, budget: int, now: float) -> int:
        limits, pool, stats = self.limits, self.pool, self.stats
        running = self.running
        while budget > 0 and len(running) < limits.max_num_seqs:
            queue = self.ready or self.waiting
            if not queue:
                break
            req = queue[0]
            hit: list[int] = []
            if req.num_computed == 0 and not req.blocks:
                hit = pool.longest_hit(req.keys, (req.num_tokens - 1) // pool.block_size)
                if req.preemptions == 0:
                    stats.prefix_queries += len(req.prompt)
                    stats.prefix_hits += len(hit) * pool.block_size
            hit_tokens = len(hit) * pool.block_size
            if req.remote_tokens and req.phase == Phase.WAITING and req.preemptions == 0:
                # Blocks for the whole prompt, then wait for the load outside the batch.
                new = pool.blocks_for(len(req.prompt)) - len(hit)
                if new + pool.evictable(hit) > pool.num_free:
                    break
                queue.popleft()
                pool.touch(hit)
                req.blocks = hit + pool.allocate(new)
                req.num_cached = len(hit)
                req.local_hit = hit_tokens
                req.phase = Phase.LOADING
                self.loading.add(req)
                step.loads.append(req)
                continue
            computed = hit_tokens or req.num_computed
            n = min(req.num_tokens - computed, budget)
            new = pool.blocks_for(computed + n) - len(hit) - len(req.blocks)
            if new + pool.evictable(hit) > pool.num_free:
                break
            queue.popleft()
            if hit:
                pool.touch(hit)
                req.blocks = hit
                req.num_cached = len(hit)
                req.num_computed = hit_tokens
                if req.preemptions == 0:  # its prefix cache hit, as vLLM's prefill stats
                    req.local_hit = hit_tokens
            if new > 0:
                req.blocks.extend(pool.allocate(new))
            req.phase = Phase.RUNNING
            running.append(req)
            self._add_to_batch(step, req, n)
            budget -= n
        return budget

    @staticmethod
    def _add_to_batch(step: Step, req: EngineRequest, n: int) -> None:
        step.batch.append((req, n))
        step.tokens += n
        computed = req.num_computed
        if n == 1 and computed >= len(req.prompt):
            step.context += computed + 1
        else:
            step.prefill_tokens += n
            step.pairs += n * (computed + n / 2)

    def _preempt(self, req: EngineRequest) -> None:
        self.pool.free(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.num_cached = 0
        req.phase = Phase.WAITING
        req.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    def complete(self, step: Step, now: float) -> list[EngineRequest]:
        """Applies a step that ended at `now`: tokens computed, tokens sampled, requests done.

        Returns the requests whose waiter should wake: first token, every `stream_interval`
        tokens, finished (phase DONE; a `hold` request still owns its blocks).
        """
        stats, pool = self.stats, self.pool
        interval = self.limits.stream_interval
        bs = pool.block_size
        caching = pool.caching
        notify: list[EngineRequest] = []
        done = False
        generated = 0
        ttft, itl = stats.ttft, stats.itl
        for req, n in step.batch:
            if req.phase != Phase.RUNNING:
                continue  # aborted during the step
            req.num_computed += n
            if caching and req.num_computed // bs > req.num_cached:
                self._cache_full_blocks(req)
            if req.num_computed < req.num_tokens:
                continue  # a prefill chunk that did not reach the end
            req.num_output += 1
            out = req.num_output
            generated += 1
            if req.first_token_at < 0:
                req.first_token_at = now
                req.first_token_step = stats.steps + 1  # this step's number (counted below)
                ttft.add(now - req.arrival)
            else:
                itl.add(now - req.last_token_at)
            req.last_token_at = now
            if out >= req.max_tokens:
                req.phase = Phase.DONE
                done = True
                if not req.hold:
                    pool.free(req.blocks)
                    req.blocks = []
                stats.finished += 1
                notify.append(req)
            elif out == 1 or out % interval == 0:
                notify.append(req)
        if done:
            self.running = [r for r in self.running if r.phase == Phase.RUNNING]
        stats.steps += 1
        stats.generation_tokens += generated
        stats.computed_tokens += step.tokens
        stats.busy_s += step.duration_ms * 1e-3
        stats.step_time.add(step.duration_ms * 1e-3 or 1e-6)
        self._sample(now)
        return notify

    def _cache_full_blocks(self, req: EngineRequest) -> None:
        pool = self.pool
        if not pool.caching:
            return
        bs = pool.block_size
        full = min(req.num_computed // bs, len(req.blocks))
        start = req.num_cached
        if full <= start:
            return
        keys = req.keys
        if len(keys) < full:
            first = len(keys)
            parent = keys[-1] if keys else NO_PARENT
            keys.extend(chain_hashes(self._tokens(req, first * bs, full * bs), bs, parent))
        parent = keys[start - 1] if start else NO_PARENT
        pool.cache(
            req.blocks[start:full],
            keys[start:full],
            parent,
            self._tokens(req, start * bs, full * bs),
        )
        req.num_cached = full

    @staticmethod
    def _tokens(req: EngineRequest, lo: int, hi: int) -> list[int]:
        prompt = req.prompt
        p = len(prompt)
        if hi <= p:
            return list(prompt[lo:hi])
        if lo >= p:
            return list(req.outputs[lo - p : hi - p])
        return [*prompt[lo:], *req.outputs[: hi - p]]

    def _sample(self, now: float) -> None:
        self.stats.sample(now, len(self.running), self.num_waiting, self.pool.usage)

    def sample(self, now: float) -> None:
        """Brings the time-weighted load counters up to `now` (before reading them)."""
        self._sample(now)
