"""The controller judged in modelled time against three other ways to size a fleet.

A modelled hour (`hour`) whose traffic changes: chat-like requests (~1k-token prompts,
~300-token answers) at a base rate, twice that rate, the base again, then summarisation-like
requests (~7.8k-token prompts, ~150-token answers) at a rate, twice it, and chat again
(10 minutes each). The same requests (one seed) are served, in `pdplane.autoscale.elastic`,
by fleets sized four ways within one GPU budget:

- **static**: what `pdplane plan` recommends for the hour's average (its mean rate, its mix
  of lengths), kept all hour;
- **reactive**: the live rules of `pdplane plan --registry` acted on at once
  (`pdplane.plan.live.advise`: a side whose queue grows or whose KV cache fills gets one more
  instance, a nearly idle side gives one back), one move per role per `cooldown_s`;
- **controller**: `pdplane.autoscale.controller.Controller`, by default with the spend target
  (`mean_gpus`) of what static holds: its SLO at no more GPU-hours;
- **oracle**: knows the phases: at each time, the plan (same predictor and margin as the
  controller) for the phase running now and for the one running a start-up later, whichever
  is larger per role, so new instances are healthy when their phase begins.

All start from the static split and pay the same move costs (start-up, drain-and-wait).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pdplane.autoscale.controller import Controller, ControllerSettings
from pdplane.autoscale.elastic import ElasticResult, ElasticSettings, Policy, simulate_elastic
from pdplane.autoscale.observe import Observation, Traffic
from pdplane.autoscale.predictor import Bounds, Predictor
from pdplane.autoscale.state import ROLES, FleetState
from pdplane.plan.live import advise
from pdplane.plan.search import Slo, plan_fleet, window
from pdplane.plan.workload import Lengths, RequestSpec, Shape, arrival_times
from pdplane.sim.profiles import Profile

__all__ = [
    "CHAT",
    "POLICIES",
    "SUMMARISE",
    "Phase",
    "Row",
    "Summary",
    "hour",
    "requests_of",
    "run_policies",
    "static_split",
    "table",
]

CHAT = Shape("chat", 20.0, Lengths(1000, "uniform", 800, 1200), Lengths(300, "uniform", 200, 400))
SUMMARISE = Shape(
    "summarise", 12.0, Lengths(7800, "uniform", 7600, 7990), Lengths(150, "uniform", 100, 200)
)
POLICIES = ("static", "reactive", "controller", "oracle")


@dataclass(frozen=True, slots=True)
class Phase:
    """`duration_s` of `shape`'s requests at `rate` req/s."""

    duration_s: float
    shape: Shape
    rate: float

    @property
    def traffic(self) -> Traffic:
        return Traffic(self.rate, self.shape.isl.expected, self.shape.osl.expected)


def hour(
    scale: float = 1.0, phase_s: float = 600.0, chat: Shape = CHAT, summarise: Shape = SUMMARISE
) -> list[Phase]:
    """The modelled hour: chat x1, x2, x1, summarisation x1, x2, chat x1 (`phase_s` each;
    the shapes' rates x `scale`)."""
    c, s = chat.rate * scale, summarise.rate * scale
    return [
        Phase(phase_s, chat, c),
        Phase(phase_s, chat, 2 * c),
        Phase(phase_s, chat, c),
        Phase(phase_s, summarise, s),
        Phase(phase_s, summarise, 2 * s),
        Phase(phase_s, chat, c),
    ]


def requests_of(phases: Sequence[Phase], seed: int) -> list[RequestSpec]:
    """The phases' requests, one after the other (seeded per phase)."""
    out: list[RequestSpec] = []
    t0 = 0.0
    for i, ph in enumerate(phases):
        for r in ph.shape.requests(ph.duration_s, rate=ph.rate, seed=seed * 1000 + i):
            if r.at < ph.duration_s:
                out.append(RequestSpec(t0 + r.at, r.prompt_tokens, r.output_tokens))
        t0 += ph.duration_s
    return out


def static_split(
    profile: Profile, slo: Slo, requests: Sequence[RequestSpec], bounds: Bounds, seed: int
) -> tuple[int, int]:
    """`pdplane plan`'s recommendation for the average of `requests`: Poisson arrivals at
    their mean rate with their prompt/output lengths drawn from them; within the budget, the
    whole budget's best split when nothing meets the SLO."""
    span = requests[-1].at - requests[0].at
    rate = len(requests) / span
    isl = sum(r.prompt_tokens for r in requests) / len(requests)
    osl = sum(r.output_tokens for r in requests) / len(requests)
    duration, warmup = window(Shape("average", rate, Lengths(round(isl)), Lengths(round(osl))), slo)
    rng = random.Random(seed)
    times = arrival_times(rng, rate, round(rate * duration))
    mixed = [
        RequestSpec(t, (pick := rng.choice(requests)).prompt_tokens, pick.output_tokens)
        for t in times
    ]
    found = plan_fleet(
        profile,
        mixed,
        slo,
        gpus=bounds.max_instances,
        max_prefill=bounds.max_prefill,
        max_decode=bounds.max_decode,
        warmup_s=warmup,
        compare=False,
    )
    if found.best is not None:
        return bounds.clamp(found.best.config.prefill, found.best.config.decode)
    best = Predictor(profile, slo, seed=seed).plan(Traffic(rate, isl, osl), bounds)
    return best.prefill, best.decode


@dataclass
class _Reactive:
    """The live rules acted on: +1 on a bound side, -1 on an idle one, per role at most once
    per `cooldown_s` and never while one of that role is starting."""

    slo: Slo
    bounds: Bounds
    cooldown_s: float
    moved_at: dict[str, float]

    def __call__(self, obs: Observation, state: FleetState, now: float) -> dict[str, int] | None:
        advice = advise(
            obs.loads,
            ttft_p90_s=obs.ttft_p90_s,
            itl_p90_s=obs.itl_p90_s,
            ttft_slo_s=self.slo.bound("ttft"),
            itl_slo_s=self.slo.bound("itl"),
        )
        wanted = {}
        for role in ROLES:
            c = state.count(role)
            step = advice.delta[role]
            recent = now - self.moved_at.get(role, -1e18) < self.cooldown_s
            if c.starting or recent:
                step = 0
            wanted[role] = c.planned + step
        x, y = self.bounds.clamp(wanted["prefill"], wanted["decode"])
        for role, n in (("prefill", x), ("decode", y)):
            if n != state.count(role).planned:
                self.moved_at[role] = now
        return {"prefill": x, "decode": y}


@dataclass
class _Oracle:
    """Sizes for the phase now and the phase one start-up (plus a tick) ahead."""

    phases: Sequence[Phase]
    predictor: Predictor
    bounds: Bounds
    margin: float
    lead_s: float

    def phase_at(self, t: float) -> Phase:
        for ph in self.phases:
            if t < ph.duration_s:
                return ph
            t -= ph.duration_s
        return self.phases[-1]

    def __call__(self, obs: Observation, state: FleetState, now: float) -> dict[str, int] | None:
        plans = []
        for ph in (self.phase_at(now), self.phase_at(now + self.lead_s)):
            plans.append(self.predictor.plan(ph.traffic.scaled(1 + self.margin), self.bounds))
        x, y = self.bounds.clamp(max(p.prefill for p in plans), max(p.decode for p in plans))
        return {"prefill": x, "decode": y}


@dataclass(frozen=True, slots=True)
class Row:
    """One policy's run: its result, the split it started from and (the controller) the log
    line of each decision that changed something, with its time (s)."""

    policy: str
    seed: int
    gpus: int
    start: tuple[int, int]
    result: ElasticResult
    decisions: tuple[tuple[float, str], ...] = ()


def run_policies(
    profile: Profile,
    slo: Slo,
    phases: Sequence[Phase],
    settings: ElasticSettings,
    *,
    seed: int,
    predictor: Predictor | None = None,
    controller: ControllerSettings | None = None,
    policies: Sequence[str] = POLICIES,
    start: tuple[int, int] | None = None,
    mean_gpus: float | None = None,
) -> list[Row]:
    """Runs each of `policies` on the same requests (`seed`) within `settings.gpus`, from
    `start` (default: `static_split`, which every policy starts from and static keeps). The
    controller's spend target is `mean_gpus` (None: the GPUs of `start`, what static holds;
    0: none).

    `predictor` may be shared between calls (its answers depend on the traffic bucket only).
    """
    bounds = Bounds(max_prefill=settings.gpus - 1, max_decode=settings.gpus - 1, gpus=settings.gpus)
    settings = replace(settings, ttft_slo_s=slo.bound("ttft"), itl_slo_s=slo.bound("itl"))
    predictor = predictor or Predictor(profile, slo)
    ctl = controller or ControllerSettings()
    requests = requests_of(phases, seed)
    span = sum(ph.duration_s for ph in phases)
    start = start or static_split(profile, slo, requests, bounds, seed)
    rows = []
    for name in policies:
        policy: Policy | None = None
        if name == "reactive":
            policy = _Reactive(slo, bounds, ctl.cooldown_s, {})
        elif name == "controller":
            target = sum(start) if mean_gpus is None else mean_gpus
            policy = Controller(predictor, bounds, replace(ctl, mean_gpus=target))
        elif name == "oracle":
            lead = settings.startup_s + settings.interval_s
            policy = _Oracle(phases, predictor, bounds, ctl.up_margin, lead)
        elif name != "static":
            raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
        result = simulate_elastic(profile, requests, start, settings, policy, span_s=span)
        said = policy.decisions if isinstance(policy, Controller) else []
        decisions = tuple((d.at, d.describe()) for d in said)
        rows.append(Row(name, seed, settings.gpus, start, result, decisions))
    return rows


@dataclass(frozen=True, slots=True)
class Summary:
    """What the table shows of one run: SLO attainment (fraction of 1-minute windows),
    goodput (req/s), GPU-hours, moves (starts + drains), unfinished requests, requests the
    gateway's flow control shed or timed out (429/503, no token)."""

    policy: str
    seed: int
    gpus: int
    start: tuple[int, int]
    attainment: float
    goodput: float
    gpu_hours: float
    moves: int
    unfinished: int
    shed: int = 0

    @classmethod
    def of(cls, row: Row) -> Summary:
        r = row.result
        return cls(
            row.policy,
            row.seed,
            row.gpus,
            row.start,
            r.attainment,
            r.goodput,
            r.gpu_hours,
            len(r.moves),
            r.unfinished,
            r.shed,
        )


def table(runs: Sequence[Summary]) -> str:
    """A Markdown table: per budget and policy, the mean over seeds of SLO attainment (and
    each seed's), goodput, GPU-hours, moves (starts + drains), unfinished requests and
    those the gateway shed."""
    lines = [
        "| GPUs | policy | SLO attainment (per seed) | goodput req/s | GPU-hours | moves | "
        "unfinished | shed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r.gpus, POLICIES.index(r.policy)) for r in runs})
    for gpus, k in keys:
        name = POLICIES[k]
        group = sorted((r for r in runs if r.gpus == gpus and r.policy == name), key=_by_seed)
        n = len(group)
        att = [r.attainment for r in group]
        per_seed = " / ".join(f"{a:.0%}" for a in att)
        starts = sorted({f"{r.start[0]}P{r.start[1]}D" for r in group})
        label = f"{name} ({', '.join(starts)})" if name == "static" else name
        lines.append(
            f"| {gpus} | {label} | {sum(att) / n:.0%} ({per_seed}) | "
            f"{sum(r.goodput for r in group) / n:.2f} | "
            f"{sum(r.gpu_hours for r in group) / n:.2f} | "
            f"{sum(r.moves for r in group) / n:.1f} | "
            f"{sum(r.unfinished for r in group) / n:.0f} | "
            f"{sum(r.shed for r in group) / n:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _by_seed(run: Summary) -> int:
    return run.seed
