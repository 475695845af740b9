"""The controller's model of the fleet: the planner's fleet simulation on the measured traffic.

`Predictor.plan(traffic, bounds)` answers the fewest prefill and decode instances whose
simulated fleet (`pdplane.plan.fleetsim`, judged by `Slo.met` as `pdplane plan` judges) meets
the SLO for Poisson arrivals at the traffic's rate with its mean prompt and output lengths
(uniform +-20 % around them), within the bounds. It starts from `pdplane plan`'s closed-form
estimate, grows the failing side until the fleet meets the SLO (decode when it is over its
capacity, breaks ITL or fills its KV cache, else prefill), then gives back what is not
needed, one side then the other: a few simulated fleets per answer, where `pdplane plan`'s
two binary searches take more (the controller answers many traffics). When no fleet within
the budget meets it: the split of the whole budget with the highest simulated goodput,
around the estimate's ratio.
`Predictor.predict(fleet, traffic)` is one simulated fleet: the before/after of a move.

A fleet counts as meeting the SLO when its simulated latencies are within `slack` (0.8) of
each target: one simulated half-minute is a sample, the fleet then serves many minutes, and a
fleet planned at the edge fails a good share of them. Each simulated fleet serves `measure_s`
of traffic after one request lifetime of warm-up. A fleet must also be stable: each role's
closed-form capacity (`pdplane.plan.search.capacity`, fully busy) at least the top of the
traffic's rate bucket. A fleet slightly over its capacity builds its queue slowly, too slowly for a
half-minute sample to show it (summarisation-like traffic at 24 req/s passes the sample on
7P2D and needs 8P3D over minutes: two decodes serve ~23 req/s of 150-token answers), and the
queue then breaks TTFT with ITL within target, which the live rules read as prefill-bound.
Answers are cached on the traffic rounded to buckets (rate: `rate_step`, lengths:
`length_step`, geometric) and the workload is generated from the rounded values with a seed
derived from them, so an answer depends on the bucket only: runs that share a `Predictor` (a
table of several policies and seeds) get the same answers as separate ones, only faster.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass

from pdplane.autoscale.observe import Traffic
from pdplane.plan.fleetsim import FleetConfig, FleetResult, simulate_fleet
from pdplane.plan.search import Slo, capacity, estimate, window
from pdplane.plan.workload import Lengths, RequestSpec, Shape
from pdplane.sim.profiles import Profile

__all__ = ["Bounds", "FleetPlan", "Predictor"]


@dataclass(frozen=True, slots=True)
class Bounds:
    """Instances per role (min, max) and the GPU budget (0 = none; one instance = one GPU
    times `gpus_per_instance`)."""

    min_prefill: int = 1
    max_prefill: int = 16
    min_decode: int = 1
    max_decode: int = 16
    gpus: int = 0
    gpus_per_instance: int = 1

    @property
    def max_instances(self) -> int:
        cap = self.max_prefill + self.max_decode
        return min(cap, self.gpus // self.gpus_per_instance) if self.gpus else cap

    def clamp(self, prefill: int, decode: int) -> tuple[int, int]:
        """(prefill, decode) within the per-role bounds, then within the budget (the larger
        side gives back first)."""
        x = min(max(prefill, self.min_prefill), self.max_prefill)
        y = min(max(decode, self.min_decode), self.max_decode)
        while x + y > self.max_instances and (x > self.min_prefill or y > self.min_decode):
            if (x >= y and x > self.min_prefill) or y <= self.min_decode:
                x -= 1
            else:
                y -= 1
        return x, y


@dataclass(frozen=True, slots=True)
class FleetPlan:
    """The answer for one traffic: counts, whether the simulated fleet meets the SLO, and its
    prediction."""

    prefill: int
    decode: int
    meets: bool
    result: FleetResult | None = None

    @property
    def label(self) -> str:
        return f"{self.prefill}P{self.decode}D"


def _bucket(value: float, step: float) -> int:
    return round(math.log(value) / math.log1p(step)) if value > 0 else -(1 << 20)


def _unbucket(k: float, step: float) -> float:
    return math.exp(k * math.log1p(step))


class Predictor:
    """Plans and predicts fleets for measured traffic (see the module docstring)."""

    def __init__(
        self,
        profile: Profile,
        slo: Slo,
        *,
        rate_step: float = 0.15,
        length_step: float = 0.3,
        measure_s: float = 30.0,
        slack: float = 0.8,
        seed: int = 0,
    ) -> None:
        self.profile = profile
        self.slo = slo
        #: what a planned fleet must meet: every target x `slack` (see the module docstring)
        self.judge = dataclasses.replace(
            slo, targets=tuple((m, q, b * slack) for m, q, b in slo.targets)
        )
        self.rate_step = rate_step
        self.length_step = length_step
        self.measure_s = measure_s
        self.seed = seed
        self._plans: dict[tuple[int, int, int, Bounds], FleetPlan] = {}
        self._runs: dict[tuple[int, int, int], dict[FleetConfig, FleetResult]] = {}
        self._loads: dict[tuple[int, int, int], tuple[list[RequestSpec], float]] = {}
        #: simulated fleets so far (the controller's cost)
        self.simulations = 0

    def key(self, traffic: Traffic) -> tuple[int, int, int]:
        """The traffic's buckets (rate, prompt length, output length)."""
        return (
            _bucket(traffic.rate, self.rate_step),
            _bucket(traffic.isl, self.length_step),
            _bucket(traffic.osl, self.length_step),
        )

    def workload(self, key: tuple[int, int, int]) -> tuple[list[RequestSpec], float]:
        """The synthetic requests of a bucket and their warm-up (s)."""
        if key not in self._loads:
            rate = _unbucket(key[0], self.rate_step)
            isl, osl = (round(_unbucket(k, self.length_step)) for k in key[1:])
            cap = self.profile.max_model_len
            osl = max(1, min(osl, cap // 4))
            isl = max(1, min(isl, int((cap - 1.2 * osl) / 1.2)))
            shape = Shape(
                "measured",
                rate,
                Lengths(isl, "uniform", max(1, round(0.8 * isl)), round(1.2 * isl)),
                Lengths(osl, "uniform", max(1, round(0.8 * osl)), round(1.2 * osl)),
            )
            duration, warmup = window(shape, self.slo)
            duration = min(duration, warmup + self.measure_s)
            seed = zlib.crc32(repr((self.seed, key)).encode())
            self._loads[key] = (shape.requests(duration, seed=seed), warmup)
        return self._loads[key]

    def _simulate(self, key: tuple[int, int, int], x: int, y: int) -> FleetResult:
        runs = self._runs.setdefault(key, {})
        cfg = FleetConfig(prefill=x, decode=y)
        if cfg not in runs:
            requests, warmup = self.workload(key)
            self.simulations += 1
            runs[cfg] = simulate_fleet(
                self.profile,
                requests,
                cfg,
                ttft_slo_s=self.slo.bound("ttft"),
                itl_slo_s=self.slo.bound("itl"),
                warmup_s=warmup,
                tail_s=2 * self.slo.bound("ttft"),
            )
        return runs[cfg]

    def capacity(self, prefill: int, decode: int, traffic: Traffic) -> float:
        """Requests per second `prefill`P`decode`D sustains with both roles fully busy on
        `traffic`'s lengths (closed form, `pdplane.plan.search.capacity`; decode = 0: the
        prefills' alone)."""
        return capacity(
            self.profile, traffic.isl, traffic.osl, self.slo.bound("itl"), prefill, decode
        )

    def _stable_side(self, key: tuple[int, int, int], x: int, y: int) -> str | None:
        """The role whose closed-form capacity is below the rate, or None; the rate at the
        top of its bucket (the answer is the bucket's, so it must hold for every rate in it),
        the lengths the bucket's simulated requests have."""
        rate = _unbucket(key[0] + 0.5, self.rate_step)
        isl, osl = (_unbucket(k, self.length_step) for k in key[1:])
        itl = self.slo.bound("itl")
        if capacity(self.profile, isl, osl, itl, 0, y) < rate:
            return "decode"
        if capacity(self.profile, isl, osl, itl, x, 0) < rate:
            return "prefill"
        return None

    def _fails(self, key: tuple[int, int, int], x: int, y: int) -> str | None:
        """The side `x`P`y`D fails on for the bucket (None: it meets the SLO, stable): decode
        when it is over its capacity, breaks ITL or fills its KV cache, else prefill."""
        unstable = self._stable_side(key, x, y)
        if unstable is not None:
            return unstable
        judge = self.judge
        r = self._simulate(key, x, y)
        if judge.met(r):
            return None
        return "decode" if not judge.kv_ok(r) or r.itl_q(0.9) > judge.bound("itl") else "prefill"

    def predict(self, prefill: int, decode: int, traffic: Traffic) -> FleetResult:
        """The simulated fleet `prefill`P`decode`D on `traffic` (cached per bucket)."""
        return self._simulate(self.key(traffic), prefill, decode)

    def plan(self, traffic: Traffic, bounds: Bounds) -> FleetPlan:
        """The fewest instances meeting the SLO on `traffic` within `bounds` (module
        docstring); raises ValueError when `traffic` is not known (no rate or lengths)."""
        if not traffic.known:
            raise ValueError("no traffic measured")
        key = self.key(traffic)
        pk = (*key, bounds)
        if pk not in self._plans:
            self._plans[pk] = self._plan(key, bounds)
        return self._plans[pk]

    def _plan(self, key: tuple[int, int, int], bounds: Bounds) -> FleetPlan:
        requests, _ = self.workload(key)
        ex, ey = estimate(self.profile, requests, self.slo)
        x, y = bounds.clamp(ex, ey)
        # Grow from the estimate until the fleet meets the SLO, the failing side first.
        while (side := self._fails(key, x, y)) is not None:
            decode_side = side == "decode"
            grown = bounds.clamp(x, y + 1) if decode_side else bounds.clamp(x + 1, y)
            if grown == (x, y):  # that side is at its bound: the other one
                grown = bounds.clamp(x + 1, y) if decode_side else bounds.clamp(x, y + 1)
            if grown == (x, y):
                return self._best_split(key, bounds, ex, ey)
            x, y = grown
        # Then give back what is not needed (each side is monotone in its count).
        for dx, dy in ((1, 0), (0, 1)):
            while (x - dx, y - dy) == bounds.clamp(x - dx, y - dy) and (
                self._fails(key, x - dx, y - dy) is None
            ):
                x, y = x - dx, y - dy
        return FleetPlan(x, y, True, self._simulate(key, x, y))

    def _best_split(self, key: tuple[int, int, int], bounds: Bounds, ex: int, ey: int) -> FleetPlan:
        """Nothing meets the SLO within the budget: the split of all of it (around the
        estimate's ratio) with the highest simulated goodput."""
        n = bounds.max_instances
        x0 = round(n * ex / (ex + ey))
        options = {bounds.clamp(x, n - x) for x in (x0 - 1, x0, x0 + 1)}
        results = [(self._simulate(key, x, y), x, y) for x, y in sorted(options)]
        best, x, y = max(results, key=lambda t: (t[0].goodput, -t[0].ttft_q(0.9)))
        return FleetPlan(x, y, self._fails(key, x, y) is None, best)
