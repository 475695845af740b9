"""The autoscaling controller: measured traffic and load -> wanted prefill and decode counts.

Each call (`Controller.decide`, every `interval_s` of the caller) reads one `Observation`:

1. **Plan**: the planner's fleet simulation (`Predictor.plan`) on the measured traffic with a
   margin: the fewest instances meeting the SLO at the measured rate x (1 + `up_margin`) is
   the scale-out line; at rate x (1 + `down_margin`), a larger margin, the scale-in line.
   Scaling out reacts fast, scaling in slowly: the scale-out line takes the higher rate of
   the whole window and of its last quarter (and the last quarter's prompt and output
   lengths), plus the prefill queue drained over `backlog_s` (requests that wait now must be
   served on top of the arrivals); the scale-in line uses the whole window.
2. **Hysteresis**: a role below its scale-out line grows to it at once; a role above its
   scale-in line shrinks to it only after it stayed above for `scale_in_after_s` and at least
   `cooldown_s` after that role last grew, and never while the window's measured TTFT or ITL
   p90 breaks its target; in between nothing moves. When the budget is full
   and one role must grow, the other gives back at once (a move between roles: vLLM fixes an
   instance's KV role at start-up, `--kv-transfer-config`, so a move is a drain plus a start).
3. **Observed check**: when the window's TTFT or ITL p90 breaks its target and the live rules
   (`pdplane.plan.live.advise`: queues, KV cache) name a side, that side gets one more instance
   than it has, unless one of that role is already starting: the simulation's profile may be
   wrong, the measurement is not.

Every change comes with the predicted before/after (the current and the wanted fleet
simulated on the measured traffic), logged by the caller and exported as metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdplane.autoscale.observe import Observation, Traffic
from pdplane.autoscale.predictor import Bounds, Predictor
from pdplane.autoscale.state import ROLES, FleetState
from pdplane.plan.fleetsim import FleetResult
from pdplane.plan.live import advise

__all__ = ["Controller", "ControllerSettings", "Decision"]


@dataclass(frozen=True, slots=True)
class ControllerSettings:
    """Margins (fractions of the measured rate) and times (s) of the hysteresis."""

    up_margin: float = 0.1
    down_margin: float = 0.3
    #: one measurement window (the callers' default window, 60 s): by then the scale-in line
    #: has held on a window measured wholly after the traffic fell, and an idle instance
    #: costs its GPU for no longer. A fleet still working off a queue does not shrink (the
    #: measured-latency guard, not this wait, covers that), and a role that grew waits the
    #: longer `cooldown_s`, so a rise is not undone on one quiet window.
    scale_in_after_s: float = 60.0
    cooldown_s: float = 120.0
    #: no decision before the window spans this long (s): a short one measures noise
    min_span_s: float = 30.0
    #: a prefill queue is planned to be served within this long, on top of the arrivals (s)
    backlog_s: float = 60.0


@dataclass(slots=True)
class Decision:
    """One call's answer: `wanted` planned counts per role (None = keep), why, and for a
    change the predicted current and wanted fleets on the measured traffic."""

    at: float
    traffic: Traffic
    current: dict[str, int]
    wanted: dict[str, int] | None
    reason: str
    before: FleetResult | None = None
    after: FleetResult | None = None

    @staticmethod
    def label(counts: dict[str, int]) -> str:
        return f"{counts.get('prefill', 0)}P{counts.get('decode', 0)}D"

    def describe(self) -> str:
        """One log line: the move, the traffic, the prediction."""
        t = self.traffic
        head = (
            f"{self.label(self.current)} -> {self.label(self.wanted)}"
            if self.wanted
            else f"keep {self.label(self.current)}"
        )
        line = (
            f"{head}: {self.reason} (traffic {t.rate:.1f} req/s, prompts {t.isl:.0f}, "
            f"outputs {t.osl:.0f} tokens)"
        )
        if self.before is not None and self.after is not None:
            b, a = self.before, self.after
            line += (
                f"; predicted TTFT p90 {b.ttft_q(0.9):.2f} -> {a.ttft_q(0.9):.2f} s, ITL p90 "
                f"{b.itl_q(0.9) * 1e3:.1f} -> {a.itl_q(0.9) * 1e3:.1f} ms, goodput "
                f"{b.goodput:.1f} -> {a.goodput:.1f} req/s"
            )
        return line


@dataclass
class Controller:
    """Decides one model's counts (see the module docstring). Usable as an
    `pdplane.autoscale.elastic.Policy`; keeps every decision that changed something."""

    predictor: Predictor
    bounds: Bounds
    settings: ControllerSettings = field(default_factory=ControllerSettings)
    decisions: list[Decision] = field(default_factory=list)
    _grew_at: dict[str, float] = field(default_factory=dict)
    _above_since: dict[str, float] = field(default_factory=dict)

    def __call__(self, obs: Observation, state: FleetState, now: float) -> dict[str, int] | None:
        return self.decide(obs, state, now).wanted

    def decide(self, obs: Observation, state: FleetState, now: float) -> Decision:
        """The wanted counts for `obs` given the fleet `state` at `now` (s)."""
        current = {role: state.count(role).planned for role in ROLES}
        traffic = obs.traffic
        if not traffic.known or obs.span_s < self.settings.min_span_s:
            return Decision(now, traffic, current, None, "no traffic measured yet")
        s, p = self.settings, self.predictor
        up = p.plan(self._rising(obs), self.bounds)
        down = up
        if any(current[role] > n for role, n in (("prefill", up.prefill), ("decode", up.decode))):
            # Only a role above the scale-out line can shrink: plan the scale-in line then.
            down = p.plan(traffic.scaled(1 + s.down_margin), self.bounds)
        lines = {"prefill": (up.prefill, down.prefill), "decode": (up.decode, down.decode)}
        # While the measured latency breaks a target, nothing shrinks: the simulated scale-in
        # line is planned for the arrivals, and a fleet still working off a queue (after a
        # phase it could not keep up with) that gives back instances grows again a minute later.
        broken = self._broken(obs)
        wanted = dict(current)
        reasons: list[str] = []
        waiting: list[str] = []
        for role in ROLES:
            grow, shrink = lines[role][0], max(lines[role])
            have = current[role]
            if have < grow:
                wanted[role] = grow
                reasons.append(f"{role} below the plan for +{s.up_margin:.0%} ({up.label})")
            elif have > shrink:
                since = self._above_since.setdefault(role, now)
                cooled = now - self._grew_at.get(role, -math.inf) >= s.cooldown_s
                if now - since >= s.scale_in_after_s and cooled and not broken:
                    wanted[role] = shrink
                    reasons.append(
                        f"{role} above the plan for +{s.down_margin:.0%} ({down.label}) "
                        f"for {now - since:.0f} s"
                    )
                else:
                    waiting.append(role)
                continue
            self._above_since.pop(role, None)
        if sum(wanted.values()) > self.bounds.max_instances:
            # A move between roles with the budget full: the role waiting to shrink goes now.
            for role in waiting:
                wanted[role] = max(lines[role])
                reasons.append(f"{role} gives back for the other role (budget full)")
        if broken:
            self._observed_check(obs, state, current, wanted, reasons)
        x, y = self.bounds.clamp(wanted["prefill"], wanted["decode"])
        wanted = {"prefill": x, "decode": y}
        if wanted == current:
            return Decision(now, traffic, current, None, "; ".join(reasons) or "within the lines")
        for role in ROLES:
            if wanted[role] > current[role]:
                self._grew_at[role] = now
                self._above_since.pop(role, None)
            elif wanted[role] < current[role]:
                self._above_since.pop(role, None)
        decision = Decision(
            now,
            traffic,
            current,
            wanted,
            "; ".join(reasons),
            p.predict(current["prefill"], current["decode"], traffic),
            p.predict(x, y, traffic),
        )
        self.decisions.append(decision)
        return decision

    def _rising(self, obs: Observation) -> Traffic:
        """The traffic the scale-out line is planned for (see the module docstring)."""
        t, r = obs.traffic, obs.recent
        pre = obs.loads.get("prefill")
        backlog = pre.waiting * pre.instances if pre is not None else 0.0
        base = Traffic(max(r.rate, t.rate), r.isl, r.osl) if r.known else t
        rate = base.rate * (1 + self.settings.up_margin) + backlog / self.settings.backlog_s
        return Traffic(rate, base.isl, base.osl)

    def _broken(self, obs: Observation) -> bool:
        """Whether the window's measured TTFT or ITL p90 breaks its target (NaN: unmeasured)."""
        slo = self.predictor.slo
        return obs.ttft_p90_s > slo.bound("ttft") or obs.itl_p90_s > slo.bound("itl")

    def _observed_check(
        self,
        obs: Observation,
        state: FleetState,
        current: dict[str, int],
        wanted: dict[str, int],
        reasons: list[str],
    ) -> None:
        ttft_slo, itl_slo = self.predictor.slo.bound("ttft"), self.predictor.slo.bound("itl")
        advice = advise(
            obs.loads,
            ttft_p90_s=obs.ttft_p90_s,
            itl_p90_s=obs.itl_p90_s,
            ttft_slo_s=ttft_slo,
            itl_slo_s=itl_slo,
        )
        for role in ROLES:
            if advice.delta[role] > 0 and wanted[role] <= current[role]:
                if state.count(role).starting:
                    continue
                wanted[role] = current[role] + 1
                reasons.append(f"observed: {'; '.join(advice.reasons)}")
