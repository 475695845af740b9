"""The modelled elastic fleet: what a move costs (start-up, drain-and-wait), deterministic."""

from __future__ import annotations

import dataclasses

from pdplane.autoscale.elastic import ElasticSettings, simulate_elastic
from pdplane.autoscale.observe import Observation
from pdplane.autoscale.state import FleetState
from pdplane.plan.workload import Lengths, Shape
from pdplane.sim.profiles import PROFILES

PROFILE = PROFILES["llama3-8b-h100"]
CHAT = Shape("chat", 4.0, Lengths(1000), Lengths(50))
SETTINGS = ElasticSettings(gpus=4, startup_s=40.0, interval_s=10.0, window_s=30.0, tail_s=30)


def _at(times: dict[float, dict[str, int]]):
    """A policy asking for fixed counts from given times on."""

    def policy(obs: Observation, state: FleetState, now: float) -> dict[str, int] | None:
        wanted = None
        for t, counts in sorted(times.items()):
            if now >= t:
                wanted = counts
        return wanted

    return policy


def test_a_started_instance_holds_its_gpu_from_the_start_and_serves_after_start_up() -> None:
    reqs = CHAT.requests(120, seed=3)
    static = simulate_elastic(PROFILE, reqs, (1, 1), SETTINGS, span_s=120)
    grown = simulate_elastic(
        PROFILE, reqs, (1, 1), SETTINGS, _at({20: {"prefill": 2, "decode": 1}}), span_s=120
    )
    assert [(t, str(m)) for t, m in grown.moves] == [(20.0, "start prefill")]
    assert grown.timeline == [(20.0, "2P1D (1 starting)")]
    # GPU-seconds: 2 instances x 120 s, plus the third from its start at 20 s.
    assert static.gpu_seconds == 240.0
    assert grown.gpu_seconds == 240.0 + 100.0


def test_scale_in_drains_and_loses_nothing() -> None:
    reqs = CHAT.requests(120, seed=4)
    policy = _at({30: {"prefill": 1, "decode": 1}})
    r = simulate_elastic(PROFILE, reqs, (2, 2), SETTINGS, policy, span_s=120)
    assert sorted(str(m) for _, m in r.moves) == ["drain decode", "drain prefill"]
    assert r.unfinished == 0 and r.requests == len(reqs)
    # The drained instances held their GPUs until idle, a moment after the drain (not 0 s).
    assert 2 * 120 + 2 * 30 < r.gpu_seconds < 2 * 120 + 2 * 40


def test_an_instance_stopped_while_starting_never_serves() -> None:
    reqs = CHAT.requests(60, seed=5)
    plan = {10: {"prefill": 2, "decode": 1}, 20: {"prefill": 1, "decode": 1}}
    r = simulate_elastic(PROFILE, reqs, (1, 1), SETTINGS, _at(plan), span_s=60)
    assert [str(m) for _, m in r.moves] == ["start prefill", "drain prefill"]
    assert r.gpu_seconds == 2 * 60 + 10


def test_the_same_inputs_give_the_same_result() -> None:
    reqs = CHAT.requests(90, rate=8, seed=6)
    plan = {10: {"prefill": 2, "decode": 2}, 50: {"prefill": 1, "decode": 1}}
    a = simulate_elastic(PROFILE, reqs, (1, 1), SETTINGS, _at(plan))
    b = simulate_elastic(PROFILE, reqs, (1, 1), SETTINGS, _at(plan))
    assert dataclasses.asdict(a) == dataclasses.asdict(b)
