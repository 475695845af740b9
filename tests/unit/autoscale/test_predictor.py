"""The controller's planner (pdplane.autoscale.predictor) on a real engine profile: a planned
fleet is stable, each role's closed-form capacity covering the rate, even where a half-minute
simulated sample of a smaller fleet meets the latency targets (its queue grows too slowly to
show)."""

from __future__ import annotations

from pdplane.autoscale.observe import Traffic
from pdplane.autoscale.predictor import Bounds, Predictor
from pdplane.plan.search import parse_slo
from pdplane.sim.profiles import PROFILES


def test_a_planned_fleet_can_serve_the_rate_on_each_role() -> None:
    predictor = Predictor(PROFILES["llama3-8b-h100"], parse_slo("ttft_p90<=1s,itl_p90<=50ms"))
    # Summarisation-like: ~7.8k-token prompts, 150-token answers; one decode serves fewer
    # than 12 req/s of them.
    traffic = Traffic(12.0, 7800, 150)
    plan = predictor.plan(traffic, Bounds(max_prefill=15, max_decode=15, gpus=16))
    assert plan.meets
    assert predictor.capacity(plan.prefill, 0, traffic) >= traffic.rate
    assert predictor.capacity(0, plan.decode, traffic) >= traffic.rate
    assert predictor.capacity(0, plan.decode - 1, traffic) < traffic.rate
