"""The controller judged in modelled time (pdplane.autoscale.proof) on a shortened hour that CI
can afford: the hour's six phases (chat x1, x2, x1, summarisation x1, x2, chat x1) at half the
table's rates within half its budget (4 GPUs: the cap still binds in the doubled
summarisation phase), 4 minutes each, answers of ~60 (chat) and ~30 (summarisation) tokens
instead of ~300 / ~150; start-up, drain, cadence and hysteresis as in the hour (docs/plan.md,
"Autoscaling in the simulator"). The cost of a simulated run grows with its requests and its
instances, so this hour costs about a quarter of one at the table's rates within 8 GPUs.
The orderings must hold: the controller meets the SLO in more 1-minute windows than the static
split and than the reactive rule, loses no request, with the spend target of what static holds
still beats static at no more GPU-hours, and a run is deterministic for its seed."""

from __future__ import annotations

import dataclasses
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

from pdplane.autoscale.elastic import ElasticSettings
from pdplane.autoscale.predictor import Bounds
from pdplane.autoscale.proof import (
    CHAT,
    SUMMARISE,
    Row,
    Summary,
    hour,
    requests_of,
    run_policies,
    static_split,
    table,
)
from pdplane.plan.search import parse_slo
from pdplane.plan.workload import Lengths
from pdplane.sim.profiles import PROFILES

PROFILE = PROFILES["llama3-8b-h100"]
SLO = parse_slo("ttft_p90<=1s,itl_p90<=50ms")
SHORT_CHAT = dataclasses.replace(CHAT, osl=Lengths(60, "uniform", 40, 80))
SHORT_SUMMARY = dataclasses.replace(SUMMARISE, osl=Lengths(30, "uniform", 20, 40))


@pytest.fixture(scope="module")
def rows() -> dict[str, Row]:
    phases = hour(scale=0.5, phase_s=240.0, chat=SHORT_CHAT, summarise=SHORT_SUMMARY)
    settings = ElasticSettings(gpus=4)
    bounds = Bounds(max_prefill=3, max_decode=3, gpus=4)
    start = static_split(PROFILE, SLO, requests_of(phases, 0), bounds, seed=0)
    # The runs are independent (the same requests from the same start): the controller's in
    # one process, static's and reactive's in another, which takes about as long. Spawned, not
    # forked: the test process may hold other tests' threads.
    # "controller" has no spend target; "spend" is the controller with the spend target of
    # what static holds (the bench's default).
    runs = {}
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        for name, policy, mean_gpus in (
            ("controller", "controller", 0.0),
            ("spend", "controller", None),
            ("static", "static", None),
            ("reactive", "reactive", None),
        ):
            runs[name] = pool.submit(
                run_policies,
                PROFILE,
                SLO,
                phases,
                settings,
                seed=0,
                policies=[policy],
                start=start,
                mean_gpus=mean_gpus,
            )
        return {name: run.result()[0] for name, run in runs.items()}


def test_the_controller_meets_the_slo_more_often_than_static_and_reactive(
    rows: dict[str, Row],
) -> None:
    att = {p: r.result.attainment for p, r in rows.items()}
    assert att["controller"] > att["static"], att
    assert att["controller"] > att["reactive"], att


def test_with_a_spend_target_it_beats_static_at_no_more_gpu_hours(rows: dict[str, Row]) -> None:
    spend, static = rows["spend"].result, rows["static"].result
    assert spend.attainment > static.attainment, (spend.attainment, static.attainment)
    assert spend.gpu_hours <= static.gpu_hours, (spend.gpu_hours, static.gpu_hours)


def test_the_controller_loses_no_request(rows: dict[str, Row]) -> None:
    c = rows["controller"].result
    assert c.requests == rows["static"].result.requests  # the same requests for all
    assert c.unfinished == 0
    assert any(m.action == "drain" for _, m in c.moves)  # it did scale in


def test_a_run_is_deterministic_for_its_seed() -> None:
    # A minute of chat, then one of summarisation: the longer prompts move the fleet.
    chat, _, _, summarise, _, _ = hour(
        scale=0.5, phase_s=60.0, chat=SHORT_CHAT, summarise=SHORT_SUMMARY
    )
    phases = [chat, summarise]
    runs = [
        run_policies(
            PROFILE,
            SLO,
            phases,
            ElasticSettings(gpus=4, startup_s=20.0),
            seed=3,
            policies=["controller"],
            start=(1, 1),
            mean_gpus=0.0,  # no spend target: a 2-minute account has no credit to move with
        )[0].result
        for _ in range(2)
    ]
    assert runs[0].moves and runs[0].moves == runs[1].moves
    assert runs[0].windows == runs[1].windows and runs[0].good == runs[1].good


def test_the_table_shows_the_requests_the_gateway_shed() -> None:
    # A run can answer every request it admitted (0 unfinished) while its gateway shed many:
    # the table says both, as means over the seeds.
    runs = [
        Summary("controller", seed, 8, (3, 1), 0.5, 10.0, 4.0, 20, 0, shed)
        for seed, shed in ((0, 100), (1, 300))
    ]
    header, _, row = table(runs).splitlines()
    assert header.endswith("| unfinished | shed |")
    assert row.endswith("| 0 | 200 |")
