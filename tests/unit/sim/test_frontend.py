"""The API server's serial term: one FIFO per instance, the same in every engine-model driver."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pdplane.plan.fit import predict
from pdplane.plan.fleetsim import FleetConfig, simulate_fleet
from pdplane.plan.sweep import Cell
from pdplane.plan.workload import RequestSpec
from pdplane.sim.frontend import Frontend
from pdplane.sim.profiles import PROFILES, CostModel, Profile, load_profile

SERIAL = CostModel(serial_request_ms=5.0, request_ms=2.0)


def test_a_burst_reaches_the_engine_one_serial_turn_apart() -> None:
    front = Frontend(SERIAL)
    assert [front.admit(0.0) for _ in range(4)] == pytest.approx([0.007, 0.012, 0.017, 0.022])


def test_spread_arrivals_do_not_queue_and_a_late_one_waits_only_for_the_one_before() -> None:
    front = Frontend(SERIAL)
    assert front.admit(0.0) == pytest.approx(0.007)
    assert front.admit(1.0) == pytest.approx(1.007)  # the FIFO was empty again
    assert front.admit(1.001) == pytest.approx(1.012)  # behind the one sent at 1.0


def test_without_the_serial_term_every_request_pays_request_ms_in_parallel() -> None:
    front = Frontend(CostModel(request_ms=2.0))
    assert [front.admit(0.5) for _ in range(3)] == pytest.approx([0.502] * 3)


# 1 ms steps whatever they hold; a burst's spread is the API server's.
_FAST = Profile("fast", "1 ms steps", CostModel(step_ms=1.0), max_model_len=4096)


def test_the_fleet_driver_queues_a_burst_on_each_instances_api_server() -> None:
    slow_api = dataclasses.replace(_FAST, cost=CostModel(step_ms=1.0, serial_request_ms=50.0))
    burst = [RequestSpec(0.0, 16, 4) for _ in range(4)]
    kw = {"ttft_slo_s": 1.0, "itl_slo_s": 0.05, "tail_s": 10.0}
    one = simulate_fleet(slow_api, burst, FleetConfig(plain=1), **kw)
    # Engine entries at 50, 100, 150, 200 ms, one 1 ms step each: TTFT 51 / 101 / 151 / 201 ms.
    assert one.ttft_q(0.01) == pytest.approx(0.051, rel=0.05)
    assert one.ttft_q(0.99) == pytest.approx(0.201, rel=0.05)
    # Two plain instances: two FIFOs, the burst splits over them.
    two = simulate_fleet(slow_api, burst, FleetConfig(plain=2), **kw)
    assert two.ttft_q(0.99) == pytest.approx(0.101, rel=0.05)
    # Disaggregated: the prefill's FIFO, then the decode's (each request's turn there starts
    # when its prefill ends, 1 ms after it entered): the last ends 200 + 1 + 50 + 1 + pull.
    dis = simulate_fleet(slow_api, burst, FleetConfig(prefill=1, decode=1), **kw)
    assert dis.ttft_q(0.99) == pytest.approx(0.252, rel=0.05)


def test_the_fit_prediction_spaces_a_burst_by_the_serial_term() -> None:
    tiny = dataclasses.replace(PROFILES["tiny-cpu"], cost=CostModel(step_ms=0.1))
    serial = CostModel(step_ms=0.1, serial_request_ms=4.0)
    lone, burst, spread = Cell(1, 64, 8), Cell(9, 64, 8), Cell(2, 64, 8, arrivals=(0.0, 1.0))
    # One 0.1 ms step to the first token; a lone request pays one turn, the median of a burst
    # of 9 five, spread-out arrivals one each.
    assert predict(tiny, serial, lone)[0] == pytest.approx(0.0041, abs=1e-4)
    assert predict(tiny, serial, burst)[0] == pytest.approx(0.0201, abs=1e-4)
    assert predict(tiny, serial, spread)[0] == pytest.approx(0.0041, abs=1e-4)


def test_a_profile_json_keeps_the_serial_term_and_one_without_it_still_loads(
    tmp_path: Path,
) -> None:
    prof = dataclasses.replace(PROFILES["tiny-cpu"], cost=SERIAL)
    path = tmp_path / "serial.json"
    path.write_text(json.dumps(prof.to_dict()))
    assert load_profile(str(path)).cost.serial_request_ms == 5.0
    old = prof.to_dict()
    del old["cost"]["serial_request_ms"]  # a file written before the term existed
    path.write_text(json.dumps(old))
    assert load_profile(str(path)).cost == dataclasses.replace(SERIAL, serial_request_ms=0.0)
