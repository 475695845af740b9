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
    #: above this rate no fleet within the bounds meets the SLO (the plan is the budget's split)
    fails_above: float = math.inf

    @staticmethod
    def per_prefill(traffic: Traffic) -> float:
        return 10.0 if traffic.isl < 4000 else 2.5

    def plan(self, traffic: Traffic, bounds: Bounds) -> FleetPlan:
        self.asked.append(traffic)
        x, y = bounds.clamp(
            math.ceil(traffic.rate / self.per_prefill(traffic)), math.ceil(traffic.rate / 20)
        )
        return FleetPlan(x, y, traffic.rate <= self.fails_above)

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


def test_an_observed_breach_after_the_prefill_queue_emptied_adds_nothing() -> None:
    # The queue was worked off within the window (500 a quarter-window ago, none now); the
    # window's TTFT p90 still shows the requests that waited. A prefill started now has
    # nothing to serve, and what the check adds would stay while the traffic lasts.
    c = _controller(down_margin=0.0)
    d = c.decide(_late(0, 500), _fleet(3, 2), now=0)
    assert d.wanted is None or d.wanted["prefill"] <= 3
    # ...nor a quarter-window later, with the queue still empty and the p90 still broken.
    d = c.decide(_late(0, 0), _fleet(3, 2), now=15)
    assert d.wanted is None or d.wanted["prefill"] <= 3


def test_no_decision_before_the_window_has_measured_anything() -> None:
    c = _controller()
    obs = _obs(30)
    obs.span_s = 5.0
    assert c.decide(obs, _fleet(1, 1), now=0).wanted is None


def test_a_fleet_with_no_traffic_at_all_shrinks_to_its_minimum_after_the_wait() -> None:
    c = _controller()
    assert c.decide(_obs(40), _fleet(1, 1), now=0).wanted == {"prefill": 4, "decode": 2}
    idle = Observation(Traffic(0.0, 0.0, 0.0), {}, span_s=60.0)
    # The same hysteresis as for a falling rate: the wait, and the cooldown after growing.
    for now in (30, 90, 119):
        assert c.decide(idle, _fleet(4, 2), now=now).wanted is None
    d = c.decide(idle, _fleet(4, 2), now=150)
    assert d.wanted == {"prefill": 1, "decode": 1}
    assert "no requests" in d.reason
    # Requests still waiting on a prefill are traffic, whatever the arrivals say.
    c = _controller()
    waiting = Observation(Traffic(0.0, 0.0, 0.0), {}, span_s=60.0, queued=3)
    for now in (0, 100, 200):
        assert c.decide(waiting, _fleet(4, 2), now=now).wanted is None


def test_a_role_held_down_by_the_bounds_says_so() -> None:
    # A fleet above --max-prefill (the bounds lowered while it ran) gives back at once; the
    # reason names it, not only the other role's growth.
    s = ControllerSettings(scale_in_after_s=60, cooldown_s=120, up_margin=0.0)
    c = Controller(FakePredictor(), Bounds(max_prefill=2, gpus=8), s)  # type: ignore[arg-type]
    d = c.decide(_obs(40), _fleet(4, 1), now=0)
    assert d.wanted == {"prefill": 2, "decode": 2}
    assert "prefill held to 2 (the bounds)" in d.reason


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


def _spending(mean_gpus: float, **kw: float) -> Controller:
    """A controller within 8 GPUs with a spend target of `mean_gpus` GPUs on average."""
    s = ControllerSettings(
        scale_in_after_s=60, cooldown_s=120, up_margin=0.0, down_margin=0.0, mean_gpus=mean_gpus
    )
    return Controller(FakePredictor(**kw), Bounds(gpus=8), s)  # type: ignore[arg-type]


def _quiet(c: Controller, until: float) -> None:
    """10 req/s (1P1D) on 1P1D from 0 to `until` s, a decision every 15 s: 2 GPUs held."""
    for now in range(0, int(until), 15):
        quiet = _obs(10, ttft_p90_s=0.3, itl_p90_s=0.02)
        assert c.decide(quiet, _fleet(1, 1), now=now).wanted is None


def test_a_spend_target_buys_more_gpus_only_with_credit_earned_below_it() -> None:
    # 30 req/s needs 3P2D (5 GPUs); the target is 4. Without credit the fleet stays within 4.
    d = _spending(4).decide(_obs(30), _fleet(1, 1), now=0)
    assert d.wanted == {"prefill": 2, "decode": 2}
    # Ten minutes on 1P1D earned 2 GPUs x 600 s: 3P2D is bought.
    c = _spending(4)
    _quiet(c, 600)
    assert c.decide(_obs(30), _fleet(1, 1), now=600).wanted == {"prefill": 3, "decode": 2}
    # One GPU over the target (held from the next decision on, 615 s) spends 1230 GPU-s in
    # 1230 s; then the fleet gives back at once, without waiting for the hysteresis (the
    # traffic has not fallen).
    for now in range(615, 1845, 15):
        assert c.decide(_obs(30), _fleet(3, 2), now=now).wanted is None, now
    d = c.decide(_obs(30), _fleet(3, 2), now=1845)
    assert d.wanted == {"prefill": 2, "decode": 2}
    assert "spend" in d.reason
    # Without a target the same controller keeps 3P2D.
    free = _spending(0)
    _quiet(free, 600)
    for now in range(600, 2000, 15):
        d = free.decide(_obs(30), _fleet(3, 2) if now > 600 else _fleet(1, 1), now=now)
        assert now == 600 or d.wanted is None


def test_a_spend_target_buys_nothing_for_traffic_no_fleet_within_the_cap_serves() -> None:
    # At 30 req/s no fleet within 8 GPUs meets the SLO: the credit stays for a phase where
    # more GPUs make it met; the fleet holds the target, and what it held above gives back
    # once that judgement held for scale_in_after_s (60 s from the first, at 600 s).
    c = _spending(4, fails_above=25)
    _quiet(c, 600)
    assert c.decide(_obs(30), _fleet(1, 1), now=600).wanted == {"prefill": 2, "decode": 2}
    for now in (615, 630, 645):
        assert c.decide(_obs(30), _fleet(4, 2), now=now).wanted is None
    d = c.decide(_obs(30), _fleet(4, 2), now=660)
    assert d.wanted is not None and sum(d.wanted.values()) == 4
    assert "no fleet within 8 GPUs meets the SLO" in d.reason
    # Within the cap, the same traffic is served: the credit buys it.
    c = _spending(4, fails_above=25)
    _quiet(c, 600)
    assert c.decide(_obs(24), _fleet(1, 1), now=600).wanted == {"prefill": 3, "decode": 2}
    # A queue on top of traffic the cap serves (20 req/s and 3000 waiting on one prefill:
    # planned as 70 req/s) is served within the target's GPUs: the credit is not spent on a
    # queue (the traffic as it is now, 20 req/s, needs 2P1D; the queue's 7P4D within 4 GPUs
    # is 2P2D).
    c = _spending(4, fails_above=25)
    _quiet(c, 600)
    d = c.decide(_obs(20, waiting=3000), _fleet(1, 1), now=600)
    assert d.wanted == {"prefill": 2, "decode": 2}


def test_above_a_spend_target_the_credit_buys_the_traffic_as_it_is_now() -> None:
    # A shift to 8k-token prompts at 10 req/s after 20 req/s of 1k ones: the window's higher
    # rate with the last quarter's lengths (20 req/s of 8k) asks for 8P1D; the last quarter
    # itself (10 req/s of 8k) for 4P1D, one GPU over the target of 4: the credit buys that.
    window, recent = Traffic(20, 1000, 300), Traffic(10, 8000, 300)
    loads = {"prefill": RoleLoad(1, 1, 0.0, 0.1), "decode": RoleLoad(1, 5)}
    shift = Observation(window, loads, span_s=60.0, recent=recent)
    c = _spending(4)
    _quiet(c, 600)
    assert c.decide(shift, _fleet(1, 1), now=600).wanted == {"prefill": 4, "decode": 1}
    # Without a target the higher rate is planned for (a rise shows in the last quarter first).
    free = _spending(0)
    assert free.decide(shift, _fleet(1, 1), now=600).wanted == {"prefill": 7, "decode": 1}


def test_above_a_spend_target_a_role_shrinks_to_the_scale_out_line() -> None:
    # 4P2D (two GPUs over the target) at 30 req/s, unmeasured latency (not comfortable): the
    # scale-in line (+50 %: 45 req/s) is 5P3D, the scale-out line 3P2D. Without a target the
    # fleet holds; above a target the wider margin is not paid for: the prefill shrinks to
    # 3 once it stayed above the line for `scale_in_after_s`.
    def held(mean_gpus: float) -> list[dict[str, int] | None]:
        s = ControllerSettings(
            scale_in_after_s=60, cooldown_s=120, up_margin=0.0, down_margin=0.5, mean_gpus=mean_gpus
        )
        c = Controller(FakePredictor(), Bounds(gpus=8), s)  # type: ignore[arg-type]
        _quiet(c, 600)
        return [c.decide(_obs(30), _fleet(4, 2), now=now).wanted for now in range(600, 700, 15)]

    assert held(0) == [None] * 7
    assert held(4) == [None] * 4 + [{"prefill": 3, "decode": 2}] + [None] * 2


def test_a_fleet_started_above_the_spend_target_gives_back_before_any_traffic() -> None:
    # 1P4D (5 GPUs) started with a target of 4 and no credit: the account never borrows, so
    # the first decision gives back a decode, traffic measured or not (here: none yet, then
    # an idle window).
    unmeasured = Observation(Traffic(0, 0, 0), {}, span_s=5.0)
    d = _spending(4).decide(unmeasured, _fleet(1, 4), now=0)
    assert d.wanted == {"prefill": 1, "decode": 3} and "spend" in d.reason
    idle = Observation(Traffic(0, 0, 0), {}, span_s=60.0)
    assert _spending(4).decide(idle, _fleet(1, 4), now=0).wanted == {"prefill": 1, "decode": 3}
    # Within the target nothing moves before traffic is measured.
    assert _spending(5).decide(unmeasured, _fleet(1, 4), now=0).wanted is None


def test_a_spend_target_does_not_flap_on_traffic_at_the_edge_of_what_the_cap_serves() -> None:
    # 4P2D bought on credit; the measured rate alternates between 24 req/s (the cap serves
    # it) and 30 (it does not): one window's verdict does not give back what is held, so
    # nothing is drained and bought again.
    c = _spending(4, fails_above=25)
    _quiet(c, 600)
    assert c.decide(_obs(24), _fleet(1, 1), now=600).wanted == {"prefill": 3, "decode": 2}
    for i, now in enumerate(range(615, 900, 15)):
        d = c.decide(_obs(30 if i % 2 == 0 else 24), _fleet(3, 2), now=now)
        assert d.wanted is None, (now, d.reason)


def test_a_spend_target_buys_only_what_its_credit_holds_through_a_start_up_and_cooldown() -> None:
    # 2 GPUs below the target for 105 s earned 210 GPU-s: 3P2D (one GPU over 4) needs
    # 1 GPU x (90 s start-up + 120 s cooldown); 6P3D (5 over) 1050: the smaller purchase is
    # made, the larger is not (the fleet keeps what it holds); with 15 s less credit, none.
    c = _spending(4)
    _quiet(c, 90)
    assert c.decide(_obs(30), _fleet(1, 1), now=90).wanted == {"prefill": 2, "decode": 2}
    c = _spending(4)
    _quiet(c, 105)
    assert c.decide(_obs(30), _fleet(1, 1), now=105).wanted == {"prefill": 3, "decode": 2}
    d = c.decide(_obs(60), _fleet(3, 2), now=120)
    assert d.wanted is None or sum(d.wanted.values()) <= 5


def test_a_spend_target_gives_back_early_enough_to_pay_for_the_drain() -> None:
    # 25 req/s on 3P2D (one GPU over the target of 4) with 3000 requests waiting that the
    # prefills serve within a start-up (600 s here): no start for them, but a drained
    # prefill holds its GPU ~100 s until its share is served. It gives back ~100 s earlier
    # than without the queue (1845 s: the credit is gone).
    def give_back_at(waiting: float) -> int:
        s = ControllerSettings(
            scale_in_after_s=60,
            cooldown_s=120,
            up_margin=0.0,
            down_margin=0.0,
            mean_gpus=4,
            startup_s=600,
        )
        c = Controller(FakePredictor(), Bounds(gpus=8), s)  # type: ignore[arg-type]
        _quiet(c, 600)
        assert c.decide(_obs(25), _fleet(1, 1), now=600).wanted == {"prefill": 3, "decode": 2}
        for now in range(615, 2000, 15):
            d = c.decide(_obs(25, waiting=waiting), _fleet(3, 2), now=now)
            if d.wanted is not None:
                assert sum(d.wanted.values()) == 4 and "spend" in d.reason
                return now
        raise AssertionError("never gave back")

    assert give_back_at(0) == 1845
    assert give_back_at(3000) == 1740


def test_under_a_spend_target_a_move_between_roles_starts_once_the_drained_gpu_is_free() -> None:
    # No credit yet, the target (4) held: 40 req/s wants 2P2D within it. The prefill gives
    # back at once, but the decode starts only once the drained prefill's GPU is free:
    # starting it beside the draining one would hold 5.
    c = _spending(4)
    assert c.decide(_obs(40), _fleet(3, 1), now=0).wanted == {"prefill": 2, "decode": 1}
    draining = FleetState({"prefill": RoleCount(2, 0, 1), "decode": RoleCount(1)})
    assert c.decide(_obs(40), draining, now=15).wanted is None
    assert c.decide(_obs(40), _fleet(2, 1), now=30).wanted == {"prefill": 2, "decode": 2}


def test_under_a_spend_target_the_observed_check_adds_only_what_the_credit_pays_for() -> None:
    # The measured breach asks for a fourth prefill beside the planned 3P2D (see
    # test_an_observed_slo_breach_on_a_queue_adds_one_to_that_side): 6 GPUs, one over a target
    # of 5, with no credit earned yet.
    grown = _spending(0).decide(_late(3000, 2500), _fleet(3, 2), now=0)
    assert grown.wanted == {"prefill": 4, "decode": 2}
    assert _spending(5).decide(_late(3000, 2500), _fleet(3, 2), now=0).wanted is None
