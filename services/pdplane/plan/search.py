"""The P:D search: the fewest instances whose simulated fleet meets the SLO.

Method (docs/plan.md):
1. a closed-form estimate seeds the search: decode instances from the batch a decode can run
   within the ITL target (step time of the profile's cost model at that batch, capped by
   `max_num_seqs` and KV capacity) and the output token rate; prefill instances from the
   prompt token rate over a full-budget step's throughput at 70 % utilisation;
2. the simulated fleet (`pdplane.plan.fleetsim`) is the judge: the smallest decode count Y
   meeting the whole SLO with prefill to spare, then the smallest prefill count X with that Y
   (each a binary search around the estimate; both sides are monotone in their count);
3. the neighbours (X-1)PYD and XP(Y-1)D and the plain fleet of X+Y instances are simulated too,
   and the smallest plain fleet meeting the SLO, so the report can say when disaggregation
   does not pay.
One instance is one GPU (the profiles have one TP size).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdplane.plan.fleetsim import FleetConfig, FleetResult, simulate_fleet
from pdplane.plan.workload import RequestSpec, Shape
from pdplane.sim.profiles import Profile

__all__ = ["Plan", "Slo", "capacity", "estimate", "parse_slo", "plan_fleet", "window"]

_SLO_RE = re.compile(r"^\s*(ttft|itl)_p(\d{1,2}(?:\.\d+)?)\s*<=\s*([\d.]+)\s*(ms|s)\s*$")


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency targets: (metric "ttft" | "itl", quantile 0..1, bound s) each, and the KV
    headroom a fleet must keep: mean KV cache usage of its serving instances (decode or plain)
    at most `kv_limit` over the window. A fleet at the KV cliff meets latency targets in a
    short window and then tips into preemptions (recomputes lengthen requests, which fills the
    cache more): the planner treats it as failing."""

    targets: tuple[tuple[str, float, float], ...]
    kv_limit: float = 0.9

    def bound(self, metric: str) -> float:
        """The tightest bound (s) on `metric`; inf when none."""
        return min((b for m, _, b in self.targets if m == metric), default=math.inf)

    def latency_met(self, r: FleetResult) -> bool:
        """Every latency target holds (and the window had requests)."""
        return r.requests > 0 and all(
            (r.ttft_q(q) if m == "ttft" else r.itl_q(q)) <= b for m, q, b in self.targets
        )

    def kv_ok(self, r: FleetResult) -> bool:
        """The serving role's mean KV cache usage is within `kv_limit`."""
        serving = r.roles.get("decode") or r.roles.get("plain")
        return serving is None or serving.mean_kv_usage <= self.kv_limit

    def met(self, r: FleetResult) -> bool:
        """The latency targets hold with the KV headroom kept."""
        return self.latency_met(r) and self.kv_ok(r)

    def __str__(self) -> str:
        return ",".join(f"{m}_p{q * 100:g}<={b * 1e3:g}ms" for m, q, b in self.targets)


def parse_slo(text: str, kv_limit: float = 0.9) -> Slo:
    """'ttft_p90<=2s,itl_p90<=50ms' -> Slo. Raises ValueError on anything else."""
    out = []
    for part in text.split(","):
        m = _SLO_RE.match(part)
        if not m:
            raise ValueError(f"bad SLO term {part!r}: expected e.g. ttft_p90<=2s or itl_p99<=50ms")
        metric, pct, value, unit = m.groups()
        q = float(pct) / 100
        if not 0 < q < 1:
            raise ValueError(f"bad percentile in {part!r}")
        out.append((metric, q, float(value) * (1e-3 if unit == "ms" else 1.0)))
    if not out:
        raise ValueError("empty SLO")
    return Slo(tuple(out), kv_limit)


def estimate(profile: Profile, requests: Sequence[RequestSpec], slo: Slo) -> tuple[int, int]:
    """Closed-form (prefill, decode) counts (see the module docstring); at least 1 each."""
    span = max(requests[-1].at - requests[0].at, 1e-9) if len(requests) > 1 else 1.0
    rate = len(requests) / span
    isl = sum(r.prompt_tokens for r in requests) / len(requests)
    osl = sum(r.output_tokens for r in requests) / len(requests)
    prefill_tps, decode_tps = _throughputs(profile, isl, osl, slo.bound("itl"))
    y = math.ceil(rate * osl / decode_tps) if decode_tps else 1
    x = math.ceil(rate * isl / (0.7 * prefill_tps)) if prefill_tps else 1
    return max(1, x), max(1, y)


def capacity(
    profile: Profile, isl: float, osl: float, itl_s: float, prefill: int, decode: int
) -> float:
    """Requests per second an XpYd fleet sustains by `estimate`'s closed form with both roles
    fully busy (no prefix cache hits): the lesser of `prefill` x prompt tokens per second of
    a full-budget step / `isl` and `decode` x output tokens per second of the largest batch
    within `itl_s` (0.8 of it, as `estimate`) / `osl`. `isl`, `osl` in tokens."""
    prefill_tps, decode_tps = _throughputs(profile, isl, osl, itl_s)
    rates = [prefill * prefill_tps / isl, decode * decode_tps / osl]
    return min(r for r in rates if r > 0) if any(r > 0 for r in rates) else math.inf


def _throughputs(profile: Profile, isl: float, osl: float, itl: float) -> tuple[float, float]:
    """(prompt tokens/s of one prefill instance at full token budget, output tokens/s of one
    decode instance at the largest batch whose step fits 0.8 x `itl` s and its KV cache);
    inf where a step takes no time."""
    c = profile.cost
    ctx = isl + osl / 2
    kv_cap = profile.num_blocks * profile.block_size / ctx

    def decode_step_s(b: int) -> float:
        return c.step_time_ms(b, 0, b, int(b * ctx), 0.0) * 1e-3

    best = 0.0
    for b in range(1, int(min(profile.max_num_seqs, kv_cap)) + 1):
        t = decode_step_s(b)
        if t > 0.8 * itl:
            break
        best = max(best, b / t if t else float(b) * 1e9)
    chunk = profile.max_num_batched_tokens
    step = c.step_time_ms(chunk, chunk, max(1, round(chunk / isl)), 0, chunk * isl / 2) * 1e-3
    return (chunk / step if step else math.inf), best


@dataclass(slots=True)
class Plan:
    """The answer: the recommendation (None when the SLO cannot be met), every simulated fleet,
    the neighbours, the plain alternatives, and how long the plan took (CPU s)."""

    slo: Slo
    estimate: tuple[int, int]
    best: FleetResult | None
    neighbours: list[FleetResult] = field(default_factory=list)
    plain_same: FleetResult | None = None
    plain_min: FleetResult | None = None
    runs: dict[FleetConfig, FleetResult] = field(default_factory=dict)
    seconds: float = 0.0
    reason: str = ""


def _min_ok(ok: Callable[[int], bool], guess: int, lo: int, hi: int) -> int | None:
    """Smallest n in [lo, hi] with ok(n) (ok monotone), probing `guess` first; None if none."""
    if hi < lo:
        return None
    g = min(max(guess, lo), hi)
    if ok(g):
        hi = g
        if g == lo or not ok(g - 1):
            return g
        hi = g - 1
    else:
        if g == hi or not ok(hi):
            return None
        lo = g + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _meets(
    slo: Slo,
    run: Callable[[FleetConfig], FleetResult],
    disagg: Callable[[int, int], FleetConfig],
    *,
    x: int = 0,
    y: int = 0,
) -> Callable[[int], bool]:
    """ok(n) for the search of one side: n decodes with `x` prefills, or n prefills with `y`."""
    return lambda n: slo.met(run(disagg(x or n, y or n)))


def plan_fleet(
    profile: Profile,
    requests: Sequence[RequestSpec],
    slo: Slo,
    *,
    gpus: int = 0,
    max_prefill: int = 32,
    max_decode: int = 32,
    warmup_s: float = 0.0,
    decode_max_num_seqs: int | None = None,
    compare: bool = True,
) -> Plan:
    """Searches XpYd fleets (X + Y <= `gpus` when given) for the fewest instances meeting `slo`.

    Each candidate is one `simulate_fleet` run over `requests` (window from `warmup_s`).
    `compare` False skips the neighbours and the plain fleets (the recommendation only: what
    the autoscaling controller asks for).
    """
    t0 = time.process_time()
    ttft_b = slo.bound("ttft")
    tail = 2 * ttft_b if math.isfinite(ttft_b) else 10.0
    runs: dict[FleetConfig, FleetResult] = {}

    def run(cfg: FleetConfig) -> FleetResult:
        if cfg not in runs:
            runs[cfg] = simulate_fleet(
                profile,
                requests,
                cfg,
                ttft_slo_s=ttft_b,
                itl_slo_s=slo.bound("itl"),
                warmup_s=warmup_s,
                tail_s=tail,
            )
        return runs[cfg]

    def disagg(x: int, y: int) -> FleetConfig:
        return FleetConfig(prefill=x, decode=y, decode_max_num_seqs=decode_max_num_seqs)

    ex, ey = estimate(profile, requests, slo)
    budget = gpus or (max_prefill + max_decode)
    cap_d = min(max_decode, budget - 1)
    plan = Plan(slo, (ex, ey), None, runs=runs)
    y: int | None = None
    x_spare = min(max_prefill, max(ex + 1, 2 * ex), max(1, budget - ey))
    for _ in range(3):
        y = _min_ok(_meets(slo, run, disagg, x=x_spare), ey, 1, min(cap_d, budget - x_spare))
        if y is not None or x_spare >= min(max_prefill, budget - 1):
            break
        x_spare = min(max_prefill, budget - 1, x_spare * 2)
    x = None
    if y is not None:
        x = _min_ok(_meets(slo, run, disagg, y=y), ex, 1, min(x_spare, budget - y))
    if x is None or y is None:
        plan.reason = (
            f"the SLO cannot be met with {budget} GPUs (max {max_prefill} prefill, "
            f"{max_decode} decode instances)"
        )
    else:
        plan.best = run(disagg(x, y))
        if compare:
            plan.neighbours = [run(disagg(a, b)) for a, b in ((x - 1, y), (x, y - 1)) if a and b]
    if not compare:
        plan.seconds = time.process_time() - t0
        return plan
    same = (x + y) if x and y else budget
    plan.plain_same = run(FleetConfig(plain=same, decode_max_num_seqs=decode_max_num_seqs))
    n = _min_ok(
        lambda k: slo.met(run(FleetConfig(plain=k, decode_max_num_seqs=decode_max_num_seqs))),
        same,
        1,
        budget,
    )
    if n is not None:
        plan.plain_min = run(FleetConfig(plain=n, decode_max_num_seqs=decode_max_num_seqs))
    plan.seconds = time.process_time() - t0
    return plan


def window(shape: Shape, slo: Slo, duration_s: float = 0.0) -> tuple[float, float]:
    """(traffic duration, warm-up) in s. A request of a fleet that meets the SLO lives at most
    about osl x ITL target + TTFT target; the decode population (and its KV use) is steady only
    after one such lifetime, so that is the warm-up; then measure half a lifetime, >= 60 s."""
    itl = slo.bound("itl")
    ttft = slo.bound("ttft")
    life = shape.osl.expected * (itl if itl < 1e9 else 0.05) + (ttft if ttft < 1e9 else 2)
    if duration_s:
        return duration_s, min(life, duration_s / 3)
    return life + max(life / 2, 60.0), life
