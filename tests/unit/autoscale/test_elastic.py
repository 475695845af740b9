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


def _recording(log: list[Observation], at: list[float] | None = None):
    """A policy that keeps the fleet and records what it observes (and when, into `at`)."""

    def policy(obs: Observation, state: FleetState, now: float) -> dict[str, int] | None:
        log.append(obs)
        if at is not None:
            at.append(now)
        return None

    return policy


def test_the_gateways_budget_holds_a_burst_back_and_loses_nothing() -> None:
    # 40 req/s for 10 s onto 1P1D; a budget of 5 % of the decode's KV cache (~6,500 tokens)
    # holds about 6 requests of ~1,050 tokens in flight: the rest wait at the gateway.
    reqs = CHAT.requests(10, rate=40, seed=7)
    free = simulate_elastic(PROFILE, reqs, (1, 1), SETTINGS, span_s=10)
    log: list[Observation] = []
    gated = dataclasses.replace(SETTINGS, inflight_budget=0.05, interval_s=2.0)
    held = simulate_elastic(PROFILE, reqs, (1, 1), gated, _recording(log), span_s=10)
    assert held.shed == 0 and held.unfinished == 0 and held.requests == len(reqs)
    # They waited their turn: a later first token than without the gateway's budget.
    assert held.windows[0].ttft_p90_s > free.windows[0].ttft_p90_s
    # The controller saw those waiting at the gateway among the queued requests.
    assert max(o.queued for o in log) > max(1, max(o.loads["prefill"].waiting for o in log))


def test_an_overload_is_shed_and_the_controller_still_sees_the_demand() -> None:
    # ~7,800-token prompts at 12 req/s for 120 s onto 1P1D: several times what one prefill
    # serves. The gateway sheds what would wait past 10 s; the instances never see it.
    long = Shape("summaries", 12.0, Lengths(7800), Lengths(50))
    reqs = long.requests(120, seed=8)
    log: list[Observation] = []
    at: list[float] = []
    gated = dataclasses.replace(SETTINGS, inflight_budget=1.0, queue_timeout_s=10.0)
    r = simulate_elastic(PROFILE, reqs, (1, 1), gated, _recording(log, at), span_s=120)
    assert r.shed > len(reqs) / 2
    assert r.unfinished < len(reqs) - r.shed  # the rest were served or still being served
    assert r.attainment == 0.0  # the shed count as a wait of the whole timeout
    # What reached the instances is the fleet's capacity; the rate observed is the offered
    # one, in every full window while the requests arrive.
    during = [o for o, t in zip(log, at, strict=True) if 40 <= t <= 120]
    assert during and all(0.8 * 12.0 < o.traffic.rate < 1.2 * 12.0 for o in during), [
        o.traffic.rate for o in during
    ]
    assert all(o.traffic.isl > 7000 for o in during)  # measured on what the prefill got
