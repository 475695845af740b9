"""The controller's hysteresis, budget moves and observed check, on a fake predictor (the
plan is a table of rate -> counts; the fleet simulation itself is tested in tests/unit/plan)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from pdplane.autoscale.controller import Controller, ControllerSettings
from pdplane.autoscale.observe import Observation, Traffic
from pdplane.autoscale.predictor import Bounds, FleetPlan
from pdplane.autoscale.state import FleetState, RoleCount
from pdplane.plan.live import RoleLoad
from pdplane.plan.search import Slo, parse_slo

SLO = parse_slo("ttft_p90<=1s,itl_p90<=50ms")


@dataclass
class FakePredictor:
    """Prefill = ceil(rate / 10), decode = ceil(rate / 20) for 1k-token prompts; prompts of
    8k tokens need 4x the prefill. A prefill serves 10 req/s of 1k-token prompts (2.5 of 8k)
    fully busy; a planned fleet must meet 0.8 x each target."""

    slo: Slo = SLO
    judge: Slo = field(
        default_factory=lambda: dataclasses.replace(
            SLO, targets=tuple((m, q, 0.8 * b) for m, q, b in SLO.targets)
        )
    )
    asked: list[Traffic] = field(default_factory=list)

    @staticmethod
    def per_prefill(traffic: Traffic) -> float:
        return 10.0 if traffic.isl < 4000 else 2.5

    def plan(self, traffic: Traffic, bounds: Bounds) -> FleetPlan:
        self.asked.append(traffic)
        x, y = bounds.clamp(
            math.ceil(traffic.rate / self.per_prefill(traffic)), math.ceil(traffic.rate / 20)
        )
        return FleetPlan(x, y, True)

    def key(self, traffic: Traffic) -> tuple[int, int, int]:
        return round(traffic.rate), round(traffic.isl), round(traffic.osl)

    def capacity(self, prefill: int, decode: int, traffic: Traffic) -> float:
        rates = [prefill * self.per_prefill(traffic), decode * 20.0]
        return min((r for r in rates if r > 0), default=math.inf)

    def predict(self, prefill: int, decode: int, traffic: Traffic) -> object:
        return _Result(traffic.rate / max(prefill, 1))


@dataclass
class _Result:
    load: float
    goodput: float = 1.0

    def ttft_q(self, q: float) -> float:
        return self.load

    def itl_q(self, q: float) -> float:
        return 0.01


def _obs(rate: float, isl: float = 1000, **kw: float) -> Observation:
    """A 60 s window at `rate` req/s; `waiting`: requests waiting on the (one) prefill, in the
    window's mean and now (`queued_before`: a quarter of the window ago, default the same)."""
    waiting = kw.pop("waiting", 0.0)
    loads = {"prefill": RoleLoad(1, 1, waiting, 0.1), "decode": RoleLoad(1, 5)}
    t = Traffic(rate, isl, 300)
    kw.setdefault("queued_before", waiting)
    return Observation(t, loads, span_s=60.0, recent=t, queued=waiting, **kw)


def _fleet(p: int, d: int, starting: tuple[int, int] = (0, 0)) -> FleetState:
    return FleetState({"prefill": RoleCount(p, starting[0]), "decode": RoleCount(d, starting[1])})


def _controller(**kw: float) -> Controller:
    s = ControllerSettings(scale_in_after_s=60, cooldown_s=120, up_margin=0.0, **kw)
    return Controller(FakePredictor(), Bounds(gpus=8), s)  # type: ignore[arg-type]


def test_scales_out_at_once_and_in_only_after_the_wait_and_the_cooldown() -> None:
    c = _controller(down_margin=0.0)
    d = c.decide(_obs(30), _fleet(1, 1), now=0)
    assert d.wanted == {"prefill": 3, "decode": 2}
    assert d.before is not None and d.after is not None  # the predicted before/after
    # Traffic falls back: nothing moves for scale_in_after_s, nor within the cooldown.
    for now in (30, 90, 119):
        assert c.decide(_obs(10), _fleet(3, 2), now=now).wanted is None
    assert c.decide(_obs(10), _fleet(3, 2), now=150).wanted == {"prefill": 1, "decode": 1}


def test_nothing_shrinks_while_the_measured_latency_breaks_a_target() -> None:
    # A fleet working off a queue: the arrivals (10 req/s) need 1P1D, the measured TTFT p90
    # (3 s) says the queue is not gone; the prefill the live rules name is already starting,
    # so nothing grows either.
    c = _controller(down_margin=0.0)
    late = _obs(10, ttft_p90_s=3.0, itl_p90_s=0.02)
    fleet = _fleet(2, 2, starting=(1, 0))
    for now in (0, 100, 200, 300):
        assert c.decide(late, fleet, now=now).wanted is None
    # Once the window meets the targets again, it shrinks (it stayed above the line long enough).
    met = _obs(10, ttft_p90_s=0.5, itl_p90_s=0.02)
    assert c.decide(met, fleet, now=400).wanted == {"prefill": 1, "decode": 1}


def test_the_band_between_the_margins_holds_the_fleet() -> None:
    c = _controller(down_margin=0.5)
    # 2P at rate 20; at rate 14 the scale-out line needs 2, the scale-in line (21) needs 3.
    for now in range(0, 1000, 50):
        assert c.decide(_obs(14), _fleet(2, 1), now=now).wanted is None


def test_a_rise_in_the_recent_traffic_and_a_queue_scale_out_before_the_window_shows_it() -> None:
    c = _controller(down_margin=0.0)
    obs = _obs(10)
    obs.recent = Traffic(30, 1000, 300)
    assert c.decide(obs, _fleet(1, 1), now=0).wanted == {"prefill": 3, "decode": 2}
    c = _controller(down_margin=0.0)
    # 10 req/s on one prefill that serves 10: no spare, so all 600 queued requests outlast a
    # start-up and are planned to be served within backlog_s (60 s): 20 req/s.
    assert c.decide(_obs(10, waiting=600), _fleet(1, 1), now=0).wanted == {
        "prefill": 2,
        "decode": 1,
    }


def test_a_shift_to_long_prompts_moves_instances_between_roles_within_the_budget() -> None:
    c = _controller(down_margin=0.0)
    # 8k-token prompts at 10 req/s: 4 prefills; the decodes over the plan give back at once
    # because the budget (8) is full.
    d = c.decide(_obs(10, isl=8000), _fleet(2, 6), now=0)
    assert d.wanted == {"prefill": 4, "decode": 1}
    assert "budget full" in d.reason


def _late(queued: float, queued_before: float) -> Observation:
    """10 req/s with TTFT broken by a prefill queue: on three prefills (30 req/s, 20 spare:
    1800 requests within a start-up), 3000 queued outlast it by 1200, planned within 60 s on
    top of the arrivals: 30 req/s, the 3P2D the fleet has."""
    return _obs(10, waiting=queued, queued_before=queued_before, ttft_p90_s=4.0, itl_p90_s=0.02)


def test_an_observed_slo_breach_on_a_queue_adds_one_to_that_side() -> None:
    c = _controller(down_margin=0.0)
    d = c.decide(_late(3000, 2500), _fleet(3, 2), now=0)
    assert d.wanted is not None and d.wanted["prefill"] == 4
    assert "observed" in d.reason
    # ...but not while an instance of that role is starting.
    c = _controller(down_margin=0.0)
    assert c.decide(_late(3000, 2500), _fleet(3, 2, starting=(1, 0)), now=0).wanted is None


def test_an_observed_breach_with_a_falling_prefill_queue_adds_nothing() -> None:
    # The same queue, falling: the fleet is catching up, and a start would serve after the
    # requests it could help with are gone (queued requests stay on their instance).
    assert (
        _controller(down_margin=0.0).decide(_late(3000, 3500), _fleet(3, 2), now=0).wanted is None
    )


def test_no_decision_before_the_window_has_measured_anything() -> None:
    c = _controller()
    obs = _obs(30)
    obs.span_s = 5.0
    assert c.decide(obs, _fleet(1, 1), now=0).wanted is None


def test_a_queue_the_ready_prefills_serve_within_a_start_up_starts_nothing() -> None:
    # 10 req/s on 3 prefills that serve 30: 20 req/s spare, 1800 requests within the 90 s
    # start-up. A start now would serve after a queue of 1000 is gone; one of 5000 outlasts it.
    fleet = _fleet(3, 2)
    c = _controller(down_margin=0.5)
    assert c.decide(_obs(10, waiting=1000), fleet, now=0).wanted is None
    grown = _controller(down_margin=0.5).decide(_obs(10, waiting=5000), fleet, now=0).wanted
    assert grown is not None and grown["prefill"] > 3


def test_a_comfortable_window_shrinks_further_than_one_near_the_targets() -> None:
    # 14 req/s: the scale-out line needs 2 prefills, the scale-in line (x1.5, 21 req/s) 3. A
    # window well within the targets and without a queue shrinks 5P to the scale-out line; one
    # within the targets but not within the planned fleet's slack only to the scale-in line.
    fleet = _fleet(5, 1)
    wanted = {}
    for name, ttft in (("comfortable", 0.3), ("near", 0.9)):
        c = _controller(down_margin=0.5)
        obs = _obs(14, ttft_p90_s=ttft, itl_p90_s=0.02)
        assert c.decide(obs, fleet, now=0).wanted is None  # not before scale_in_after_s
        wanted[name] = c.decide(obs, fleet, now=200).wanted
    assert wanted["comfortable"] is not None and wanted["near"] is not None
    assert wanted["comfortable"]["prefill"] < wanted["near"]["prefill"] < 5


def test_what_the_observed_check_added_stays_while_its_traffic_lasts() -> None:
    # The plan says 3P2D for the queue; the measurement says more: the check adds a fourth.
    c = _controller(down_margin=0.5)
    assert c.decide(_late(3000, 2500), _fleet(3, 2), now=0).wanted == {"prefill": 4, "decode": 2}
    # The queue gone, the window comfortable on 4P: the same traffic keeps the fourth...
    calm = _obs(10, ttft_p90_s=0.3, itl_p90_s=0.02)
    for now in (100, 200, 300):
        d = c.decide(calm, _fleet(4, 2), now=now)
        assert d.wanted is None or d.wanted["prefill"] >= 4
    # ...until the traffic falls by more than the scale-in margin.
    fewer = _obs(6, ttft_p90_s=0.3, itl_p90_s=0.02)
    c.decide(fewer, _fleet(4, 2), now=400)
    d = c.decide(fewer, _fleet(4, 2), now=500)
    assert d.wanted is not None and d.wanted["prefill"] < 4


def test_a_role_shrinks_to_the_highest_line_of_its_wait_not_the_last_one() -> None:
    # 3P above a line of 2 (14 req/s) for a minute, then one window of 8 req/s (1P): it
    # shrinks to 2, the line the last scale_in_after_s asked for at most.
    c = _controller(down_margin=0.0)
    for now in (200, 215, 230, 245):
        assert c.decide(_obs(14), _fleet(3, 1), now=now).wanted is None
    assert c.decide(_obs(8), _fleet(3, 1), now=260).wanted == {"prefill": 2, "decode": 1}
