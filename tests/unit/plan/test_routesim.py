"""Routing on the virtual clock: the scheduler's policies over a fleetsim fleet, orderings only.

Small versions of the routing scorecard's points (bench/routing/scorecard.py): a 2P2D fleet of the
Llama-3-8B H100 profile with its KV cache cut to 2,000 blocks (32k tokens) per instance, so
that where a prefix is cached depends on the routing. Each run is deterministic for its seed.
"""

from __future__ import annotations

import dataclasses

import pytest

from bench.routing import workloads as wl
from bench.routing.scorecard import mean_lengths, sessions
from pdplane.plan.fleetsim import FleetConfig, simulate_fleet
from pdplane.plan.routesim import ChatTraffic, ChatTurn, SchedulerRouter, run_routed
from pdplane.plan.search import capacity
from pdplane.scheduler.warming import WarmSettings
from pdplane.sim.profiles import PROFILES, Profile

PROFILE = dataclasses.replace(PROFILES["llama3-8b-h100"], num_blocks=2000)
FLEET = FleetConfig(prefill=2, decode=2)
LOAD_ONLY = ("least_loaded", "power_of_two", "round_robin")


def _run(workload: wl.Workload, router: str, profile: Profile = PROFILE) -> dict[str, float]:
    traffic = ChatTraffic(sessions(workload))
    warmup = workload.duration_s / 3
    return run_routed(profile, FLEET, traffic, router, warmup_s=warmup).numbers()


@pytest.fixture(scope="module")
def shared() -> dict[str, dict[str, float]]:
    # 24 tenants x 2,000-token system prompts: 48k tokens, more than one instance's cache.
    work = wl.shared_prefix(14.0, 420, tenants=24, system_tokens=2000, seed=3)
    return {r: _run(work, r) for r in ("kv_aware", "round_robin", "oracle")}


def test_a_run_is_deterministic() -> None:
    work = wl.shared_prefix(8.0, 80, tenants=4, system_tokens=1000, seed=1)
    assert _run(work, "kv_aware") == _run(work, "kv_aware")


def test_kv_aware_keeps_prefixes_where_they_are_cached(
    shared: dict[str, dict[str, float]],
) -> None:
    kv, rr, oracle = shared["kv_aware"], shared["round_robin"], shared["oracle"]
    assert kv["fleet_hit"] > rr["fleet_hit"] + 0.2, (kv, rr)
    assert kv["fleet_hit"] >= oracle["fleet_hit"] - 0.03, (kv, oracle)
    assert kv["ttft_p90_ms"] < rr["ttft_p90_ms"], (kv, rr)
    assert kv["requests"] == rr["requests"] == oracle["requests"] > 200


def test_on_cold_prompts_kv_aware_is_no_slower_than_the_load_only_policies() -> None:
    # Unique prompts (caching cannot help) at ~half the prefills' capacity, whole caches.
    work = wl.cold(15.0, 450, seed=5)
    got = {r: _run(work, r, PROFILES["llama3-8b-h100"]) for r in ("kv_aware", *LOAD_ONLY)}
    kv = got["kv_aware"]
    assert kv["fleet_hit"] == 0.0
    for metric in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p99_ms"):
        best = min(got[r][metric] for r in LOAD_ONLY)
        assert kv[metric] <= 1.05 * best, (metric, {r: got[r][metric] for r in got})


def test_past_saturation_on_cold_prompts_kv_aware_spreads_decodes_as_round_robin_does() -> None:
    # 1.2x the prefills' capacity: prompts queue for seconds before reaching their decode.
    # Decode reports that hid the requests on their way had kv_aware's decodes swing between
    # idle and twice their share: ITL p99 1.24x round_robin's here.
    isl, osl = mean_lengths(wl.cold(10.0, 100, seed=5))
    rate = 1.2 * capacity(PROFILES["llama3-8b-h100"], isl, osl, 0.05, 2, 2)
    work = wl.cold(rate, round(rate * 30), seed=5)
    kv, rr = (_run(work, r, PROFILES["llama3-8b-h100"]) for r in ("kv_aware", "round_robin"))
    assert min(kv["prefill_busy"], rr["prefill_busy"]) > 0.95  # saturated
    assert kv["itl_p99_ms"] <= 1.05 * rr["itl_p99_ms"], (kv, rr)


def test_follow_up_turns_carry_the_answers_and_hit_their_prefix() -> None:
    work = wl.multi_turn(1.5, 30, turns=4, system_tokens=300, think_s=1.0, seed=2)
    kv, rr = _run(work, "kv_aware"), _run(work, "round_robin")
    assert kv["requests"] == rr["requests"] > 60  # follow-ups arrive in the window
    assert kv["fleet_hit"] > rr["fleet_hit"], (kv, rr)


def test_with_the_first_token_from_prefill_follow_ups_still_hit_and_ttft_drops() -> None:
    # Decode's prompt is one token longer (the first token appended): the follow-up turns
    # carry the whole answer all the same, and the TTFT holds neither the pull nor decode.
    work = wl.multi_turn(1.5, 30, turns=4, system_tokens=300, think_s=1.0, seed=2)
    runs = {
        mode: run_routed(
            PROFILE, FLEET, ChatTraffic(sessions(work)), "kv_aware", warmup_s=10.0, first_token=mode
        ).numbers()
        for mode in ("decode", "prefill")
    }
    split, whole = runs["prefill"], runs["decode"]
    assert split["requests"] == whole["requests"] > 50
    assert split["fleet_hit"] == pytest.approx(whole["fleet_hit"], abs=0.02)
    assert split["ttft_p50_ms"] < whole["ttft_p50_ms"]


def test_the_traffic_repeats_the_answer_in_the_next_turn() -> None:
    turns = [
        ChatTurn(0.0, [{"role": "user", "content": "the first question"}], 5),
        ChatTurn(1.0, [{"role": "user", "content": "and a second"}], 3),
    ]
    traffic = ChatTraffic([turns])
    first = traffic.prompt(0)
    answer = traffic.outputs(0, 5)
    follow = traffic.follow_up(0, 7, now=2.0)
    assert follow is not None and follow.at == 3.0 and follow.output_tokens == 3
    second = traffic.prompt(7)
    assert second[: len(first)] == first  # the whole first turn is the next one's prefix
    assert second[len(first) : len(first) + 5] == answer
    assert len(second) == follow.prompt_tokens
    assert traffic.follow_up(7, 8, now=4.0) is None  # the session's last turn


def test_load_reports_reach_the_scheduler_on_the_heartbeat() -> None:
    work = wl.poisson(20.0, 40, wl.Lengths(500), wl.Lengths(50), seed=0)
    traffic = ChatTraffic(sessions(work))
    router = SchedulerRouter(
        PROFILE,
        traffic,
        (0.0, 2.0),
        prefill_policy="least_loaded",
        decode_policy="least_loaded",
        heartbeat_s=0.5,
    )
    simulate_fleet(PROFILE, traffic.requests, FLEET, ttft_slo_s=2.0, itl_slo_s=0.05, router=router)
    # Each instance publishes a report when its load changed, at most one per heartbeat:
    # 4 instances over the ~6 s run (2 s of arrivals + 4 s of tail) at 0.5 s.
    assert 4 < router.source.revision <= 4 + 4 * 13


def test_a_prefix_every_request_reads_is_warmed_onto_the_idle_prefills() -> None:
    # hot-prefix's scorecard point at 30 % load, 4P4D, seed 0: one 5,000-token system prompt
    # for every request. Without warming only the prefill that computed it first ever holds
    # it, and the TTFT tail queues there (p99 56 vs 46 ms with warming).
    fleet = FleetConfig(prefill=4, decode=4)
    isl, osl = mean_lengths(wl.hot_prefix(10.0, 100, seed=0))
    rate = 0.3 * capacity(PROFILES["llama3-8b-h100"], isl, osl, 0.05, 4, 4)
    work = wl.FAMILY["hot-prefix"](rate, 60.0, 0)
    warmed, cold = (
        run_routed(
            PROFILES["llama3-8b-h100"],
            fleet,
            ChatTraffic(sessions(work)),
            "kv_aware",
            warmup_s=20.0,
            warm=warm,
        ).numbers()
        for warm in (WarmSettings(), WarmSettings(min_tokens=0))
    )
    assert cold["warms"] == 0
    assert 1 <= warmed["warms"] <= fleet.prefill - 1, warmed  # at most once per other prefill
    assert warmed["ttft_p99_ms"] < cold["ttft_p99_ms"], (warmed, cold)
    assert warmed["requests"] == cold["requests"] > 200
