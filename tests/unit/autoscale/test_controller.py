"""The controller's hysteresis, budget moves and observed check, on a fake predictor (the
plan is a table of rate -> counts; the fleet simulation itself is tested in tests/unit/plan)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdplane.autoscale.controller import Controller, ControllerSettings
from pdplane.autoscale.observe import Observation, Traffic
from pdplane.autoscale.predictor import Bounds, FleetPlan
from pdplane.autoscale.state import FleetState, RoleCount
from pdplane.plan.live import RoleLoad
from pdplane.plan.search import parse_slo


@dataclass
class FakePredictor:
    """Prefill = ceil(rate / 10), decode = ceil(rate / 20) for 1k-token prompts; prompts of
    8k tokens need 4x the prefill."""

    slo: object = field(default_factory=lambda: parse_slo("ttft_p90<=1s,itl_p90<=50ms"))
    asked: list[Traffic] = field(default_factory=list)

    def plan(self, traffic: Traffic, bounds: Bounds) -> FleetPlan:
        self.asked.append(traffic)
        per_prefill = 10.0 if traffic.isl < 4000 else 2.5
        x, y = bounds.clamp(math.ceil(traffic.rate / per_prefill), math.ceil(traffic.rate / 20))
        return FleetPlan(x, y, True)

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
    loads = {"prefill": RoleLoad(1, 1, kw.pop("waiting", 0.0), 0.1), "decode": RoleLoad(1, 5)}
    t = Traffic(rate, isl, 300)
    return Observation(t, loads, span_s=60.0, recent=t, **kw)


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
    # 10 req/s plus 600 queued requests to serve within backlog_s (60 s): 20 req/s.
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


def test_an_observed_slo_breach_on_a_queue_adds_one_to_that_side() -> None:
    c = _controller(down_margin=0.0)
    broken = _obs(10, waiting=3.0, ttft_p90_s=4.0, itl_p90_s=0.02)
    broken.loads["prefill"] = RoleLoad(1, 1, 3.0, 0.1)
    d = c.decide(broken, _fleet(2, 1), now=0)
    assert d.wanted is not None and d.wanted["prefill"] == 3
    assert "observed" in d.reason
    # ...but not while an instance of that role is starting.
    c = _controller(down_margin=0.0)
    assert c.decide(broken, _fleet(2, 1, starting=(1, 0)), now=0).wanted is None


def test_no_decision_before_the_window_has_measured_anything() -> None:
    c = _controller()
    obs = _obs(30)
    obs.span_s = 5.0
    assert c.decide(obs, _fleet(1, 1), now=0).wanted is None
