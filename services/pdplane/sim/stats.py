"""What one simulated engine counts: latencies in modelled seconds, time-weighted load, events.

Cheap on the hot path (one log and one list increment per sample), read by `GET /sim/stats`
and the benchmarks (which diff two reads to get a window's numbers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EngineStats", "LogHistogram"]


class LogHistogram:
    """Counts of positive samples in logarithmic buckets (2 % wide, 10 us .. 3 h).

    `quantile` answers to within one bucket; `counts` is a plain list, so two snapshots can be
    subtracted to get the histogram of a time window.
    """

    __slots__ = ("counts", "sum", "total")

    _LO = 1e-5
    _STEP = math.log(1.02)
    _N = int(math.log(1e4 / 1e-5) / math.log(1.02)) + 2

    def __init__(self, counts: list[int] | None = None) -> None:
        self.counts = counts if counts is not None else [0] * self._N
        self.total = sum(self.counts)
        self.sum = 0.0

    def add(self, value: float, weight: int = 1) -> None:
        """Adds `weight` samples of `value` (seconds; values <= 10 us land in the first bucket)."""
        i = int(math.log(value / self._LO) / self._STEP) + 1 if value > self._LO else 0
        self.counts[min(i, self._N - 1)] += weight
        self.total += weight
        self.sum += value * weight

    def count_below(self, bound: float) -> int:
        """Samples below `bound` seconds (to within one bucket)."""
        if bound <= self._LO:
            return self.counts[0]
        i = int(math.log(bound / self._LO) / self._STEP) + 1
        return sum(self.counts[: min(i, self._N)])

    def quantile(self, q: float) -> float:
        """The `q` quantile (0..1) in seconds (bucket midpoint); NaN when empty."""
        if not self.total:
            return float("nan")
        rank = q * self.total
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank and c:
                return self._LO * math.exp((i - 0.5) * self._STEP) if i else self._LO
        return self._LO * math.exp((self._N - 1.5) * self._STEP)

    def minus(self, earlier: LogHistogram) -> LogHistogram:
        out = LogHistogram([a - b for a, b in zip(self.counts, earlier.counts, strict=True)])
        out.sum = self.sum - earlier.sum
        return out

    def merge(self, other: LogHistogram) -> LogHistogram:
        out = LogHistogram([a + b for a, b in zip(self.counts, other.counts, strict=True)])
        out.sum = self.sum + other.sum
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON: sparse [bucket, count] pairs and the sum of the samples (s)."""
        return {"sum": self.sum, "buckets": [[i, c] for i, c in enumerate(self.counts) if c]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LogHistogram:
        counts = [0] * cls._N
        for i, c in d["buckets"]:
            counts[i] = c
        out = cls(counts)
        out.sum = float(d["sum"])
        return out


@dataclass
class EngineStats:
    """Counters of one engine since start (times in modelled seconds, sizes in bytes/tokens).

    `*_integral` fields are time integrals (value x modelled seconds) of the engine's running
    and waiting requests and KV usage: two reads give the time-weighted mean of a window.
    """

    steps: int = 0
    busy_s: float = 0.0
    lag_s: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    computed_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    external_queries: int = 0
    external_hits: int = 0
    preemptions: int = 0
    finished: int = 0
    aborted: int = 0
    kv_loads: int = 0
    kv_load_failures: int = 0
    kv_bytes_in: int = 0
    kv_bytes_out: int = 0
    push_received: int = 0
    push_refused: int = 0
    push_overflow_recomputes: int = 0
    recomputed_prompts: int = 0
    max_running: int = 0
    max_waiting: int = 0
    max_kv_usage: float = 0.0
    running_integral: float = 0.0
    waiting_integral: float = 0.0
    kv_usage_integral: float = 0.0
    clock_s: float = 0.0
    ttft: LogHistogram = field(default_factory=LogHistogram)
    itl: LogHistogram = field(default_factory=LogHistogram)
    step_time: LogHistogram = field(default_factory=LogHistogram)

    def sample(self, now: float, running: int, waiting: int, usage: float) -> None:
        """Accumulates the load held since the last sample up to `now` (modelled s)."""
        dt = now - self.clock_s
        if dt > 0:
            self.running_integral += running * dt
            self.waiting_integral += waiting * dt
            self.kv_usage_integral += usage * dt
            self.clock_s = now
        if running > self.max_running:
            self.max_running = running
        if waiting > self.max_waiting:
            self.max_waiting = waiting
        if usage > self.max_kv_usage:
            self.max_kv_usage = usage

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, value in self.__dict__.items():
            out[name] = value.to_dict() if isinstance(value, LogHistogram) else value
        return out
