"""The engine model on a virtual clock: a whole workload in milliseconds of CPU, deterministic.

For tests (behaviour without sleeps), the calibration's fitting loop and what-if questions
about one engine. The served simulator (`pdplane sim`) uses the same `EngineCore`, stepped in
real time by `pdplane.sim.runner`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from pdplane.sim.engine import EngineCore, EngineRequest, Phase

__all__ = ["OfflineRun", "RequestTiming", "run_offline"]


@dataclass(slots=True)
class RequestTiming:
    """When one request's tokens came (modelled seconds from the run's start)."""

    request_id: str
    arrival: float
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


@dataclass(slots=True)
class OfflineRun:
    timings: dict[str, RequestTiming]
    end: float
    core: EngineCore


def run_offline(
    core: EngineCore,
    arrivals: Iterable[tuple[float, EngineRequest]],
    *,
    load_s: float = 0.0,
    max_steps: int = 10_000_000,
) -> OfflineRun:
    """Runs `arrivals` ((time s, request), any order) to completion on `core`.

    Remote KV loads (requests with `remote_tokens`) take `load_s` and always succeed. Every
    request gets one token time per generated token. Raises RuntimeError if the run has not
    finished after `max_steps` steps (a request that can never be scheduled).
    """
    pending = sorted(arrivals, key=lambda a: a[0])
    pending.reverse()  # pop() from the end = earliest first
    loads: list[tuple[float, int, EngineRequest]] = []
    timings: dict[str, RequestTiming] = {}
    tracked: list[EngineRequest] = []
    now = 0.0
    seq = 0
    for _ in range(max_steps):
        while pending and pending[-1][0] <= now:
            t, req = pending.pop()
            core.add(req, t)
            timings[req.request_id] = RequestTiming(req.request_id, t)
            tracked.append(req)
        while loads and loads[0][0] <= now:
            _, _, req = heapq.heappop(loads)
            core.load_done(req, True, now)
        step = core.schedule(now)
        for req in step.loads:
            seq += 1
            heapq.heappush(loads, (now + load_s, seq, req))
        if not step.batch:
            nxt = [
                x
                for x in (pending[-1][0] if pending else None, loads[0][0] if loads else None)
                if x is not None
            ]
            if not nxt:
                if core.has_work:
                    raise RuntimeError("requests wait for KV blocks that never free")
                return OfflineRun(timings, now, core)
            now = max(now, min(nxt))
            continue
        before = {id(r): r.num_output for r, _ in step.batch}
        now += step.duration_ms * 1e-3
        core.complete(step, now)
        for req, _ in step.batch:
            if req.phase in (Phase.RUNNING, Phase.DONE) and req.num_output > before[id(req)]:
                timings[req.request_id].token_times.append(now)
    raise RuntimeError(f"not finished after {max_steps} steps")
