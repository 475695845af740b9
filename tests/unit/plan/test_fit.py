"""The cost-model fit of `pdplane profile`, on cells made by the engine model itself."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from pdplane.plan.fit import fit_cost, predict, unbatched_ttft_weight
from pdplane.plan.sweep import Cell, CellResult, mixed_arrivals
from pdplane.sim.profiles import PROFILES

BASE = PROFILES["tiny-cpu"]
TRUTH = dataclasses.replace(BASE.cost, step_ms=3.0, token_ms=0.02, request_ms=8.0)
CELLS = [Cell(1, 64, 8), Cell(1, 512, 8), Cell(4, 256, 8)]
FIELDS = ("step_ms", "token_ms", "request_ms")


def _measured(burst_ttft_factor: float = 1.0) -> list[CellResult]:
    out = []
    for cell in CELLS:
        ttft, itl = predict(BASE, TRUTH, cell)
        if cell.batch > 1:
            ttft *= burst_ttft_factor
        out.append(CellResult(cell, [ttft] * cell.batch, [itl] * (cell.output - 1)))
    return out


def test_unbatched_ttft_weight_drops_only_bursts() -> None:
    assert unbatched_ttft_weight(Cell(1, 64, 8)) == 1.0
    assert unbatched_ttft_weight(Cell(1, 768, 8, shared_prefix=640)) == 1.0
    assert unbatched_ttft_weight(Cell(8, 64, 8, arrivals=mixed_arrivals(8, 10.0, 1))) == 1.0
    assert unbatched_ttft_weight(Cell(4, 64, 8)) == 0.0


def test_fit_recovers_the_cost_model_that_made_the_cells() -> None:
    measured = _measured()
    cost, score = fit_cost(BASE, measured, fields=FIELDS, iters=200)
    assert score < 1e-3
    for real in measured:
        ttft, itl = predict(BASE, cost, real.cell)
        assert math.isclose(ttft, real.ttft, rel_tol=0.03)
        assert math.isclose(itl, real.itl, rel_tol=0.03)


def test_a_burst_cost_outside_the_model_does_not_move_lone_requests() -> None:
    # The burst's TTFT is 1.6x what the engine model can make of it (the API server's serial
    # handling of its requests): fitted, it drags the single-request TTFTs off; left out, not.
    measured = _measured(burst_ttft_factor=1.6)
    lone = [r for r in measured if r.cell.batch == 1]

    def worst_lone_error(ttft_weight: Callable[[Cell], float] | None) -> float:
        cost, _ = fit_cost(BASE, measured, fields=FIELDS, iters=200, ttft_weight=ttft_weight)
        return max(abs(predict(BASE, cost, r.cell)[0] - r.ttft) / r.ttft for r in lone)

    assert worst_lone_error(unbatched_ttft_weight) < 0.03
    assert worst_lone_error(None) > 0.05


def test_fit_recovers_the_api_servers_serial_term_from_bursts() -> None:
    # Serial turns (1.5 ms) shorter than a step (3 ms): the bursts of short prompts tell them
    # from the engine's batching.
    truth = dataclasses.replace(TRUTH, serial_request_ms=1.5)
    cells = [Cell(1, 64, 8), Cell(1, 512, 8), Cell(4, 64, 8), Cell(16, 64, 8), Cell(4, 512, 8)]
    measured = []
    for cell in cells:
        ttft, itl = predict(BASE, truth, cell)
        measured.append(CellResult(cell, [ttft] * cell.batch, [itl] * (cell.output - 1)))
    fields = (*FIELDS, "serial_request_ms")
    cost, score = fit_cost(BASE, measured, fields=fields, iters=300)
    assert score < 1e-3
    assert math.isclose(cost.serial_request_ms, 1.5, rel_tol=0.1)
    assert math.isclose(cost.request_ms, 8.0, rel_tol=0.1)
