"""The autoscaling controller: measured traffic and load -> wanted prefill and decode counts.

Each call (`Controller.decide`, every `interval_s` of the caller) reads one `Observation`:

1. **Plan**: the planner's fleet simulation (`Predictor.plan`) on the measured traffic with a
   margin: the fewest instances meeting the SLO at the measured rate x (1 + `up_margin`) is
   the scale-out line; at rate x (1 + `down_margin`), a larger margin, the scale-in line.
   Scaling out reacts fast, scaling in slowly: the scale-out line takes the higher rate of
   the whole window and of its last quarter (and the last quarter's prompt and output
   lengths), plus the part of the prefill queue that outlasts a start-up, served within
   `backlog_s`: requests already queued stay on their instance (the gateway routes on
   arrival) and an instance started now serves `startup_s` later, so the queue the planned
   prefills serve by then with their capacity beyond the arrivals needs no start. The
   scale-in line uses the whole window.
2. **Hysteresis**: a role below its scale-out line grows to it at once; a role above its
   scale-in line shrinks only after it stayed above for `scale_in_after_s`, to the highest
   line of that time, at least `cooldown_s` after that role last grew, and never while the
   window's measured TTFT or ITL p90 breaks its target; in between nothing moves. A window
   comfortably within the targets (within what a planned fleet must meet, `Predictor.judge`)
   with no prefill queue lowers the scale-in line to the scale-out line: the measurement
   confirms what the wider margin guards against. When the budget is full and one role must
   grow, the other gives back at once (a move between roles: vLLM fixes an instance's KV role
   at start-up, `--kv-transfer-config`, so a move is a drain plus a start).
3. **Observed check**: when the window's TTFT or ITL p90 breaks its target and the live rules
   (`pdplane.plan.live.advise`: queues, KV cache) name a side, that side gets one more instance
   than it has, unless one of that role is starting or became ready since the last call (the
   window does not show it yet), or (prefill) no prefill queue that is not falling outlasts
   what the planned prefills serve within a start-up (a falling queue, or none left while the
   window's p90 still shows the requests that waited in it, explains the breach): the
   simulation's profile may be wrong, the measurement is not. What it added stays while the
   traffic it was added for lasts (the same length buckets, the rate not down by the scale-in
   margin).
4. **Spend target** (`mean_gpus`, `pdplane.autoscale.spend`): the lines are planned within
   the GPU cap only while the account pays for it: a fleet above the target is bought only
   when the plan for the arrivals (without the queue) within the cap meets the SLO and the
   credit pays for the extra GPUs through a start-up and a cooldown; what is bought above the
   target is the plan for the traffic as it is now (the last quarter, its own rate and
   lengths, with the scale-out margin), not for the queue or the window's higher rate (when
   that plan fits within the target, the whole scale-out line is planned within it), and a
   fleet above the target shrinks to the scale-out line, not the scale-in line. What is
   held above the target for a phase no fleet within the cap serves gives back once that
   judgement has held for `scale_in_after_s`; a fleet above the target with no credit (one
   started so) gives back at the first call, traffic measured or not. Otherwise
   they are planned within the target (or, when only the credit is short, within what the fleet
   already holds), and the roles above them give back at once; likewise once the credit no
   longer pays for what is held above the target until the next call and while the drains
   run.

Every change comes with the predicted before/after (the current and the wanted fleet
simulated on the measured traffic), logged by the caller and exported as metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdplane.autoscale.observe import Observation, Traffic
from pdplane.autoscale.predictor import Bounds, FleetPlan, Predictor
from pdplane.autoscale.spend import SpendAccount, SpendLimit
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
    #: the part of the prefill queue the ready prefills do not serve within a start-up is
    #: planned to be served within this long, on top of the arrivals (s)
    backlog_s: float = 60.0
    #: from a start until the instance serves (s; vLLM loads the weights and warms up): a
    #: start helps only with what is still waiting then
    startup_s: float = 90.0
    #: spend target: mean GPUs held over `spend_window_s` (0 = none; `pdplane.autoscale.spend`)
    mean_gpus: float = 0.0
    spend_window_s: float = 3600.0


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
    #: role -> its scale-in lines (time s, count) over the last `scale_in_after_s`
    _lines: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    #: ready instances per role at the last call, and the roles that got one more since
    _ready: dict[str, int] = field(default_factory=dict)
    _readied: set[str] = field(default_factory=set)
    #: role -> (count, window traffic) the observed check last grew it to
    _observed: dict[str, tuple[int, Traffic]] = field(default_factory=dict)
    #: the spend target (None: none; `settings.mean_gpus`)
    spend: SpendLimit | None = None
    #: when the spend target was last looked at (s)
    _spend_at: float | None = None
    #: since when (s) no fleet within the cap has met the SLO, on every decision since
    _unmet_since: float | None = None

    def __post_init__(self) -> None:
        s = self.settings
        if self.spend is None and s.mean_gpus > 0:
            # A purchase serves after its start-up and is held at least a cooldown.
            account = SpendAccount(s.mean_gpus, s.spend_window_s)
            self.spend = SpendLimit(account, self.bounds, s.startup_s + s.cooldown_s)

    def __call__(self, obs: Observation, state: FleetState, now: float) -> dict[str, int] | None:
        return self.decide(obs, state, now).wanted

    def decide(self, obs: Observation, state: FleetState, now: float) -> Decision:
        """The wanted counts for `obs` given the fleet `state` at `now` (s)."""
        current = {role: state.count(role).planned for role in ROLES}
        ready = {role: state.count(role).ready for role in ROLES}
        self._readied = {r for r in ROLES if ready[r] > self._ready.get(r, ready[r])}
        self._ready = ready
        if self.spend is not None:
            self.spend.account.record(now, state.gpus_held)
        traffic = obs.traffic
        idle = obs.span_s >= self.settings.min_span_s and traffic.rate == 0 and not obs.queued
        if idle or not traffic.known or obs.span_s < self.settings.min_span_s:
            # Nothing to plan for; a fleet above the spend target still gives back at once
            # when the credit does not pay for it (one started above it, say).
            over = self._over_spend(state, current, traffic, now)
            if over is not None:
                return over
            if idle:
                return self._idle(obs, current, now)
            return Decision(now, traffic, current, None, "no traffic measured yet")
        s, p = self.settings, self.predictor
        rising = self._rising(obs, state)
        up = p.plan(rising, self.bounds)
        spend = self.spend
        if spend is not None and up.prefill + up.decode > spend.target:
            # Above the spend target the credit pays for the traffic as it is now, not for
            # the queue or the window's higher rate (module docstring, 4); within the target
            # the whole line is planned (those GPUs are paid for).
            now_line = p.plan(self._now(obs), self.bounds)
            if now_line.prefill + now_line.decode > spend.target:
                rising, up = self._now(obs), now_line
            else:
                up = p.plan(rising, spend.within(spend.target))
        bounds, spend_note = self._spend_bounds(obs, state, up, now)
        if bounds != self.bounds:
            up = p.plan(rising, bounds)
        down = up
        # A window comfortably within the targets (those a planned fleet must meet) with no
        # prefill queue shows the fleet is more than enough: it may shrink to the scale-out
        # line. Otherwise only to the scale-in line, planned with the wider margin, which a
        # fleet held above the spend target does not pay for.
        comfortable = self._comfortable(obs, state)
        lean = spend is not None and state.gpus_held > spend.account.mean_gpus
        if not (comfortable or lean) and any(
            current[role] > n for role, n in (("prefill", up.prefill), ("decode", up.decode))
        ):
            # Only a role above the scale-out line can shrink: plan the scale-in line then.
            down = p.plan(traffic.scaled(1 + s.down_margin), bounds)
        lines = {"prefill": (up.prefill, down.prefill), "decode": (up.decode, down.decode)}
        # While the measured latency breaks a target, nothing shrinks: the simulated scale-in
        # line is planned for the arrivals, and a fleet still working off a queue (after a
        # phase it could not keep up with) that gives back instances grows again a minute later.
        broken = self._broken(obs)
        wanted = dict(current)
        reasons: list[str] = []
        waiting: list[str] = []
        for role in ROLES:
            grow, shrink = lines[role][0], max(*lines[role], self._observed_floor(role, traffic))
            have = current[role]
            if have < grow:
                wanted[role] = grow
                reasons.append(f"{role} below the plan for +{s.up_margin:.0%} ({up.label})")
            elif have > shrink:
                # The role shrinks to the highest line of the last `scale_in_after_s`: a line
                # that dips for one window's noise would ask for the instance again a tick later.
                since = self._above_since.setdefault(role, now)
                recent = self._lines.setdefault(role, [])
                recent[:] = [(t, n) for t, n in recent if t > now - s.scale_in_after_s]
                recent.append((now, shrink))
                peak = max(n for _, n in recent)
                cooled = now - self._grew_at.get(role, -math.inf) >= s.cooldown_s
                if now - since >= s.scale_in_after_s and cooled and not broken:
                    wanted[role] = peak
                    if comfortable:
                        line = f"the plan for +{s.up_margin:.0%} ({up.label}), latency comfortable"
                    elif lean:
                        line = (
                            f"the plan for +{s.up_margin:.0%} ({up.label}), above the spend target"
                        )
                    else:
                        line = f"the plan for +{s.down_margin:.0%} ({down.label})"
                    reasons.append(f"{role} above {line} for {now - since:.0f} s")
                else:
                    waiting.append(role)
                continue
            self._above_since.pop(role, None)
            self._lines.pop(role, None)
        if sum(wanted.values()) > bounds.max_instances:
            # A move between roles with the budget full, or a fleet over what the spend
            # target lets it hold: the role waiting to shrink goes now.
            for role in waiting:
                wanted[role] = max(*lines[role], self._observed_floor(role, traffic))
                why = spend_note if bounds != self.bounds else "for the other role (budget full)"
                reasons.append(f"{role} gives back {why}")
        if broken:
            self._observed_check(obs, state, current, wanted, reasons)
            if spend and bounds == self.bounds and not spend.pays(sum(wanted.values()), state, now):
                # The check's instance is a purchase above the target like any other.
                bounds = spend.within(max(spend.target, sum(current.values())))
                reasons.append("(spend: the credit does not pay for the observed check's)")
        asked = wanted
        x, y = bounds.clamp(wanted["prefill"], wanted["decode"])
        wanted = {"prefill": x, "decode": y}
        if bounds != self.bounds:
            # Under the spend target, a start waits for a drained GPU as under the GPU cap.
            wanted = SpendLimit.starts_within(wanted, state, bounds)
            x, y = wanted["prefill"], wanted["decode"]
        for role in ROLES:
            if wanted[role] < asked[role]:  # the reasons above asked for more than this
                why = spend_note if bounds != self.bounds and spend_note else "(the bounds)"
                reasons.append(f"{role} held to {wanted[role]} {why}")
        if wanted == current:
            return Decision(now, traffic, current, None, "; ".join(reasons) or "within the lines")
        for role in ROLES:
            if wanted[role] > current[role]:
                self._grew_at[role] = now
            if wanted[role] != current[role]:
                self._above_since.pop(role, None)
                self._lines.pop(role, None)
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

    def _over_spend(
        self, state: FleetState, current: dict[str, int], traffic: Traffic, now: float
    ) -> Decision | None:
        """Before anything is measured (or with no traffic): the fleet within the spend
        target when it holds more than the target and the credit does not pay for that
        until this decision (the account never borrows); None otherwise."""
        spend, last = self.spend, self._spend_at
        self._spend_at = now
        if spend is None:
            return None
        extra = state.gpus_held - spend.account.mean_gpus
        credit = spend.account.credit(now)
        if extra <= 0 or (credit > 0 and credit >= extra * (now - (last or now))):
            return None
        x, y = spend.within(spend.target).clamp(current["prefill"], current["decode"])
        wanted = {"prefill": x, "decode": y}
        if wanted == current:
            return None
        for role in ROLES:
            self._above_since.pop(role, None)
            self._lines.pop(role, None)
        why = f"(spend: the credit for more than {spend.account.mean_gpus:g} GPUs is spent)"
        changed = [role for role in ROLES if wanted[role] < current[role]]
        decision = Decision(
            now, traffic, current, wanted, "; ".join(f"{role} gives back {why}" for role in changed)
        )
        self.decisions.append(decision)
        return decision

    def _idle(self, obs: Observation, current: dict[str, int], now: float) -> Decision:
        """No request arrived within the window and none waits: each role shrinks to its
        minimum, with a falling rate's hysteresis (above it for `scale_in_after_s`, and
        `cooldown_s` after it grew). No plan to ask for: the predictor plans for a rate."""
        s, b = self.settings, self.bounds
        wanted = dict(current)
        reasons: list[str] = []
        for role, least in (("prefill", b.min_prefill), ("decode", b.min_decode)):
            if current[role] <= least:
                self._above_since.pop(role, None)
                continue
            since = self._above_since.setdefault(role, now)
            cooled = now - self._grew_at.get(role, -math.inf) >= s.cooldown_s
            if now - since >= s.scale_in_after_s and cooled:
                wanted[role] = least
                reasons.append(f"{role}: no requests for {obs.span_s:.0f} s")
        if wanted == current:
            return Decision(now, obs.traffic, current, None, "no requests in the window")
        for role in ROLES:
            if wanted[role] != current[role]:
                self._above_since.pop(role, None)
                self._lines.pop(role, None)
        decision = Decision(now, obs.traffic, current, wanted, "; ".join(reasons))
        self.decisions.append(decision)
        return decision

    def _spend_bounds(
        self, obs: Observation, state: FleetState, plan: FleetPlan, now: float
    ) -> tuple[Bounds, str]:
        """The bounds the lines are planned within under the spend target (module docstring,
        4), given `plan`, the scale-out line within the GPU cap, and why when they are
        narrower than the cap."""
        last, self._spend_at = self._spend_at, now
        spend = self.spend
        if spend is None:
            return self.bounds, ""
        # Giving back is not instant: what is held above the target now is held until the
        # next decision, and beyond the instances still starting (they stop at once), each
        # one given back is a serving instance that drains: a prefill holds its GPU until its
        # share of the queue is served. The credit must pay for that.
        gpi = self.bounds.gpus_per_instance
        extra = max(0.0, state.gpus_held - spend.account.mean_gpus)
        starting = sum(state.count(role).starting for role in ROLES) * gpi
        per_prefill = self.predictor.capacity(1, 0, obs.traffic)
        drain_s = obs.queued / max(1, state.count("prefill").ready) / per_prefill
        interval = now - last if last is not None else 0.0
        keep = extra * interval + max(0.0, extra - starting) * drain_s
        # "No fleet within the cap meets the SLO" gives back to the target only once that
        # judgement held for `scale_in_after_s`: on traffic near what the cap serves, one
        # window's noise would otherwise give back and buy again each decision.
        verdicts: list[bool] = []

        def arrivals_met() -> bool:
            verdicts.append(self._steady(obs).meets)
            return verdicts[-1]

        since = self._unmet_since
        keep_unmet = since is None or now - since < self.settings.scale_in_after_s
        bounds = spend.bounds(plan, arrivals_met, state, keep, now, keep_unmet)
        self._unmet_since = (since if since is not None else now) if verdicts == [False] else None
        return bounds

    def _steady(self, obs: Observation) -> FleetPlan:
        """The plan within the GPU cap for the arrivals of the scale-out line, without the
        part for a queue."""
        arrivals = self._arrivals(obs).scaled(1 + self.settings.up_margin)
        return self.predictor.plan(arrivals, self.bounds)

    @staticmethod
    def _arrivals(obs: Observation) -> Traffic:
        """The higher rate of the window and of its last quarter, with the last quarter's
        lengths (a rise or a shift shows there first)."""
        t, r = obs.traffic, obs.recent
        return Traffic(max(r.rate, t.rate), r.isl, r.osl) if r.known else t

    def _rising(self, obs: Observation, state: FleetState) -> Traffic:
        """The traffic the scale-out line is planned for (see the module docstring)."""
        base = self._arrivals(obs)
        rate = base.rate * (1 + self.settings.up_margin)
        backlog = self._lasting_queue(obs, state, base)
        return Traffic(rate + backlog / self.settings.backlog_s, base.isl, base.osl)

    def _observed_floor(self, role: str, traffic: Traffic) -> int:
        """The count the observed check last grew `role` to while the window's traffic is
        still what it was then (the same length buckets, the rate not below it by the
        scale-in margin), else 0: the measurement showed the plan short for that traffic,
        and a comfortable window on the grown fleet does not make it right."""
        if role not in self._observed:
            return 0
        n, then = self._observed[role]
        key, key_then = self.predictor.key(traffic), self.predictor.key(then)
        if key[1:] == key_then[1:] and traffic.rate * (1 + self.settings.down_margin) >= then.rate:
            return n
        del self._observed[role]
        return 0

    def _now(self, obs: Observation) -> Traffic:
        """The traffic as it is now, with the scale-out margin: the window's last quarter
        (its own rate and lengths), else the window."""
        now = obs.recent if obs.recent.known else obs.traffic
        return now.scaled(1 + self.settings.up_margin)

    def _lasting_queue(self, obs: Observation, state: FleetState, traffic: Traffic) -> float:
        """Requests waiting on the prefills now that the planned prefills (ready and
        starting: one started now serves after them) do not serve within a start-up
        (`startup_s`) with their closed-form capacity beyond the arrivals: the part of the
        queue an instance started now can still help with."""
        planned = state.count("prefill").planned
        spare = max(0.0, self.predictor.capacity(planned, 0, traffic) - traffic.rate)
        return max(0.0, obs.queued - spare * self.settings.startup_s)

    def _comfortable(self, obs: Observation, state: FleetState) -> bool:
        """Whether the window's TTFT and ITL p90 are within what a planned fleet must meet
        (`Predictor.judge`: the targets x its slack) with fewer requests waiting on the
        prefills than there are prefills (the live rules' queue threshold, one per
        instance). NaN (unmeasured) is not comfortable."""
        judge = self.predictor.judge
        return (
            obs.ttft_p90_s <= judge.bound("ttft")
            and obs.itl_p90_s <= judge.bound("itl")
            and obs.queued < max(1, state.count("prefill").ready)
        )

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
        queue = obs.loads["prefill"].waiting >= 1.0
        falling = obs.queued < obs.queued_before
        for role in ROLES:
            if advice.delta[role] > 0 and wanted[role] <= current[role]:
                # One is starting, or one just became ready: the window does not show what
                # it does yet.
                if state.count(role).starting or role in self._readied:
                    continue
                # Only a prefill queue that is not falling and outlasts a start-up is one more
                # prefill's to serve: one that is falling or that the ready prefills serve within a
                # start-up explains the breach, and with none left the window's p90 still shows
                # the requests that waited in it. A start would serve after they are gone
                # (requests already queued stay on their instance).
                if role == "prefill" and not (
                    queue and not falling and self._lasting_queue(obs, state, obs.traffic)
                ):
                    continue
                wanted[role] = current[role] + 1
                self._observed[role] = (wanted[role], obs.traffic)
                reasons.append(f"observed: {'; '.join(advice.reasons)}")
