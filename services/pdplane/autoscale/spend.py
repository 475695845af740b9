"""The controller's spend target: a mean number of GPUs held over a rolling window.

A platform team pays for GPU-hours. `--mean-gpus M` says what it is willing to pay on
average: what a fixed fleet of M GPUs would cost, e.g. the static split `pdplane plan`
recommends for the average traffic. Time spent below M (a quiet phase on 1P1D) earns credit;
the controller spends it on holding more than M where that meets the SLO, and nowhere else:

- **Credit** (`SpendAccount.credit`): M x the time the account has run (at most `window_s`)
  minus the GPU-seconds held within the last `window_s`. It starts at zero: credit is earned
  before it is spent, never borrowed against a quiet phase that may not come, so the mean
  over any window the account has seen whole stays within M (up to the estimate of the
  drains below). Credit leaves the window `window_s` after it was earned, so a purchase is
  paid for with what is still in the window when it ends (`SpendAccount.affords`).
- **Buying above M** (`SpendLimit.bounds`): a fleet of more than M GPUs is bought only when
  the plan for the arrivals (without the queue: a fleet catching up on a queue meets the SLO
  once it is served) within the GPU cap meets the SLO (a phase the cap cannot serve within
  the SLO gets no credit: it is kept for a phase where it makes the SLO met) and the credit
  pays for the extra GPUs through a start-up and a cooldown (the controller shrinks no role
  sooner after growing it): a purchase that would be given back before it served is not
  made. Otherwise the controller plans within M GPUs
  (or, when only the credit is short, within what it holds). A start beside a draining
  instance is a purchase too when both together hold more than M.
- **Giving back**: the fleet returns to at most M GPUs at once, whatever the hysteresis
  would wait for, when the credit no longer pays for what it holds above M until the next
  decision and while the drains run (an instance still starting stops at once, a drained
  prefill holds its GPU until its queue is served): giving back later would overspend.
  Within M, a move between roles starts the other role once the drained GPU is free
  (`SpendLimit.starts_within`), as `plan_moves` does under the GPU cap.

The account samples the GPUs held (draining instances included, as the budget counts them)
at each decision and holds that count until the next one.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdplane.autoscale.predictor import Bounds, FleetPlan
from pdplane.autoscale.state import ROLES, FleetState

__all__ = ["SpendAccount", "SpendLimit"]


@dataclass
class SpendAccount:
    """GPU-seconds held against a target of `mean_gpus` over the last `window_s` seconds."""

    mean_gpus: float
    window_s: float = 3600.0
    #: (time s, GPUs held from then on), oldest first; the first is the account's start
    _held: deque[tuple[float, int]] = field(default_factory=deque)
    _start: float | None = None

    def record(self, now: float, gpus_held: int) -> None:
        """The fleet holds `gpus_held` GPUs from `now` (s, any monotonic clock) on."""
        if self._start is None:
            self._start = now
        self._held.append((now, gpus_held))
        # Keep the last sample that began before the window: it covers the window's start.
        while len(self._held) > 1 and self._held[1][0] <= now - self.window_s:
            self._held.popleft()

    def held_gpu_s(self, now: float) -> float:
        """GPU-seconds held within the last `window_s` up to `now`."""
        return self._held_between(now - self.window_s, now)

    def _held_between(self, lo: float, hi: float) -> float:
        """GPU-seconds held within [lo, hi] (hi: at most the latest time asked about)."""
        total = 0.0
        samples = list(self._held)
        for i, (t, gpus) in enumerate(samples):
            end = samples[i + 1][0] if i + 1 < len(samples) else hi
            total += gpus * max(0.0, min(end, hi) - max(t, lo))
        return total

    def credit(self, now: float) -> float:
        """GPU-seconds the target allows beyond what was held (module docstring); 0 before
        the first record."""
        if self._start is None:
            return 0.0
        allowed = self.mean_gpus * min(now - self._start, self.window_s)
        return allowed - self.held_gpu_s(now)

    def affords(self, now: float, gpus: float, hold_s: float) -> bool:
        """Whether the credit pays for holding `gpus` GPUs from `now` for `hold_s` seconds
        (always, for `gpus` within the target): the credit `hold_s` later, with `gpus` held
        meanwhile, is not negative. Credit earned more than `window_s` before then has left
        the window by then: a young account spends (gpus - target) x `hold_s` of its
        credit, an older one also what the window's oldest part earned."""
        if gpus <= self.mean_gpus:
            return True
        if self._start is None:
            return False
        later = now + hold_s
        allowed = self.mean_gpus * min(later - self._start, self.window_s)
        past = self._held_between(later - self.window_s, now)
        return allowed - past - gpus * min(hold_s, self.window_s) >= 0


@dataclass
class SpendLimit:
    """The spend target applied to one model's fleet within the GPU cap `cap` (module
    docstring): `hold_s` is how long a purchase must be paid for (the controller's start-up
    and cooldown)."""

    account: SpendAccount
    cap: Bounds
    hold_s: float

    @property
    def target(self) -> int:
        """The target in instances (at least one)."""
        return max(1, int(self.account.mean_gpus // self.cap.gpus_per_instance))

    def within(self, instances: int) -> Bounds:
        """The cap with its GPU budget lowered to `instances` instances."""
        gpus = instances * self.cap.gpus_per_instance
        return dataclasses.replace(self.cap, gpus=min(gpus, self.cap.gpus or gpus))

    def pays(self, instances: int, state: FleetState, now: float) -> bool:
        """Whether `instances` planned (ready and starting) are no purchase (with the draining
        instances, which hold their GPU until idle, within the target or what is held now)
        or the credit pays for their GPUs above the target for `hold_s`."""
        held = sum(state.count(role).held for role in ROLES)
        after = instances + sum(state.count(role).draining for role in ROLES)
        if after <= max(self.target, held):
            return True
        return self.account.affords(now, after * self.cap.gpus_per_instance, self.hold_s)

    def bounds(
        self,
        plan: FleetPlan,
        arrivals_met: Callable[[], bool],
        state: FleetState,
        keep_gpu_s: float,
        now: float,
        keep_unmet: bool = False,
    ) -> tuple[Bounds, str]:
        """The bounds to plan within, and why when narrower than the cap: `plan` is the
        scale-out line within the cap, `arrivals_met()` whether the plan for the arrivals
        alone (no queue) within the cap meets the SLO, `keep_gpu_s` what giving back what is
        held above the target costs from now on (held until the next decision, then the
        drains; GPU-seconds). `keep_unmet`: when no fleet within the cap meets the SLO,
        keep what is held (buying nothing more) instead of giving back to the target: the
        caller's judgement has not held long enough yet (one window's noise)."""
        if self.account.credit(now) < keep_gpu_s:
            why = f"(spend: the credit for more than {self.account.mean_gpus:g} GPUs is spent)"
            return self.within(self.target), why
        wanted = plan.prefill + plan.decode
        held = max(self.target, sum(state.count(role).planned for role in ROLES))
        if wanted > self.target and not arrivals_met():
            gpus = self.cap.max_instances * self.cap.gpus_per_instance
            why = f"(spend: no fleet within {gpus} GPUs meets the SLO)"
            return self.within(held if keep_unmet else self.target), why
        if self.pays(wanted, state, now):
            return self.cap, ""
        # Keep what the credit already bought; buy nothing more.
        return self.within(held), f"(spend: the credit does not pay for {plan.label})"

    @staticmethod
    def starts_within(wanted: dict[str, int], state: FleetState, bounds: Bounds) -> dict[str, int]:
        """`wanted` (planned counts) with its starts limited to what `bounds` leaves free of
        the instances held now, draining ones included (and those this decision drains:
        they hold their GPU until idle)."""
        free = bounds.max_instances - sum(state.count(role).held for role in ROLES)
        out = dict(wanted)
        for role in ROLES:
            have = state.count(role).planned
            grow = min(max(0, wanted[role] - have), max(0, free))
            if wanted[role] > have:
                out[role] = have + grow
            free -= grow
        return out
