"""Live advice: which side of a running fleet is the bottleneck, from the registry's load reports.

`LoadWindow` keeps the load reports (`pdplane.v1.LoadReport`, what every instance heartbeats)
sampled over a sliding window; `advise` turns a window into a verdict per role. The rules
(docs/plan.md), per role over the window's samples, per instance:
- **prefill-bound**: prefill instances hold a queue (mean waiting >= `queue_high`), or the
  gateway's TTFT p90 breaks its target while ITL meets its own;
- **decode-bound**: decode instances hold a queue (waiting minus those only waiting for a KV
  pull, approximated by waiting >= `queue_high`), their KV cache is nearly full (mean usage >=
  `kv_high`), or the gateway's TPOT p90 breaks the ITL target;
- a role with more than one instance, not bound, whose mean running + waiting per instance is
  below `idle_low` can give one instance back.
Instances of role `both` count on both sides.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pdplane.v1 import instance_pb2

__all__ = ["Advice", "LoadWindow", "RoleLoad", "advise", "histogram_quantile", "mean_loads"]


@dataclass(slots=True)
class RoleLoad:
    """One role's mean load per instance over the window (requests; KV usage 0..1)."""

    instances: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0


@dataclass(slots=True)
class Advice:
    """The verdict: `bottleneck` in {"prefill", "decode", "both", "none"}, the change of
    instances per role (+1 add, -1 remove, 0 keep), why, and the loads it read."""

    bottleneck: str
    delta: dict[str, int]
    reasons: list[str]
    loads: dict[str, RoleLoad]
    ttft_p90_s: float = math.nan
    itl_p90_s: float = math.nan
    samples: int = 0

    @property
    def summary(self) -> str:
        if self.bottleneck == "none":
            moves = [f"remove {r}" for r, d in self.delta.items() if d < 0]
            return "balanced" + (f", {', '.join(moves)}" if moves else ", keep")
        adds = " and ".join(r for r, d in self.delta.items() if d > 0)
        return f"{self.bottleneck}-bound, add {adds}"


@dataclass(slots=True)
class LoadWindow:
    """Load reports sampled over the last `window_s` seconds (monotonic clock)."""

    window_s: float
    samples: deque[tuple[float, list[tuple[str, instance_pb2.LoadReport]]]] = field(
        default_factory=deque
    )

    def add(self, instances: Iterable[instance_pb2.Instance], now: float | None = None) -> None:
        """Records one ListInstances answer (serving instances only; draining ones skipped)."""
        t = time.monotonic() if now is None else now
        rows = []
        for inst in instances:
            if inst.state == instance_pb2.INSTANCE_STATE_DRAINING:
                continue
            role = instance_pb2.Role.Name(inst.spec.role).removeprefix("ROLE_").lower()
            load = instance_pb2.LoadReport()
            load.CopyFrom(inst.load)
            rows.append((role, load))
        self.samples.append((t, rows))
        while self.samples and self.samples[0][0] < t - self.window_s:
            self.samples.popleft()

    def loads(self) -> dict[str, RoleLoad]:
        """Mean per-instance load of each role (prefill, decode) over the window."""
        return mean_loads(
            [(role, load.num_running, load.num_waiting, load.kv_cache_usage) for role, load in rows]
            for _, rows in self.samples
        )


def mean_loads(samples: Iterable[Iterable[tuple[str, float, float, float]]]) -> dict[str, RoleLoad]:
    """Mean load per instance of each role over `samples`: each sample lists its instances as
    (role, running, waiting, KV usage 0..1); `both` counts on both sides; `instances` is the
    mean number of instances per sample."""
    out = {"prefill": RoleLoad(), "decode": RoleLoad()}
    n = 0
    for rows in samples:
        n += 1
        for role, running, waiting, kv_usage in rows:
            for side in ("prefill", "decode") if role == "both" else (role,):
                agg = out.get(side)
                if agg is None:
                    continue
                agg.instances += 1
                agg.running += running
                agg.waiting += waiting
                agg.kv_usage += kv_usage
    for agg in out.values():
        k = agg.instances
        if k:
            agg.running, agg.waiting, agg.kv_usage = (
                agg.running / k,
                agg.waiting / k,
                agg.kv_usage / k,
            )
        agg.instances = k / n if n else 0.0
    return out


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """The `q` quantile (s) of a Prometheus histogram's cumulative (upper bound, count)
    buckets, interpolated linearly inside a bucket as Prometheus' `histogram_quantile` does;
    NaN when empty."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    lo_bound, lo_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lo_bound
            span = count - lo_count
            frac = (rank - lo_count) / span if span else 1.0
            return lo_bound + (bound - lo_bound) * frac
        lo_bound, lo_count = bound, count
    return lo_bound


def advise(
    loads: dict[str, RoleLoad],
    *,
    ttft_p90_s: float = math.nan,
    itl_p90_s: float = math.nan,
    ttft_slo_s: float = math.inf,
    itl_slo_s: float = math.inf,
    queue_high: float = 1.0,
    kv_high: float = 0.9,
    idle_low: float = 0.25,
) -> Advice:
    """The verdict for one window (see the module docstring for the rules)."""
    p, d = loads["prefill"], loads["decode"]
    reasons: list[str] = []
    ttft_bad = ttft_p90_s > ttft_slo_s
    itl_bad = itl_p90_s > itl_slo_s
    p_bound = p.instances > 0 and p.waiting >= queue_high
    if p_bound:
        reasons.append(f"prefill queue {p.waiting:.1f} per instance >= {queue_high:g}")
    if ttft_bad and not itl_bad:
        p_bound = True
        reasons.append(f"TTFT p90 {ttft_p90_s:.3f} s > {ttft_slo_s:g} s with ITL within target")
    d_bound = False
    if d.instances > 0 and d.waiting >= queue_high:
        d_bound = True
        reasons.append(f"decode queue {d.waiting:.1f} per instance >= {queue_high:g}")
    if d.instances > 0 and d.kv_usage >= kv_high:
        d_bound = True
        reasons.append(f"decode KV cache {d.kv_usage:.0%} used >= {kv_high:.0%}")
    if itl_bad:
        d_bound = True
        reasons.append(f"ITL p90 {itl_p90_s * 1e3:.1f} ms > {itl_slo_s * 1e3:g} ms")
    if p_bound and d_bound:
        # A decode queue holds back prefill completions' hand-off; name the side that is worse.
        bottleneck = "both"
    elif p_bound:
        bottleneck = "prefill"
    elif d_bound:
        bottleneck = "decode"
    else:
        bottleneck = "none"
    delta = {"prefill": int(p_bound), "decode": int(d_bound)}
    if bottleneck == "none":
        for role, load in loads.items():
            if load.instances > 1.5 and load.running + load.waiting < idle_low:
                delta[role] = -1
                reasons.append(
                    f"{role} nearly idle ({load.running + load.waiting:.2f} requests per instance)"
                )
    return Advice(bottleneck, delta, reasons, loads, ttft_p90_s, itl_p90_s)
