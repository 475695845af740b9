"""Fits a profile's cost model to measured cells by simulating them on the engine model.

Each candidate cost model is run through `pdplane.sim.offline.run_offline` on the same cells
(same batch sizes, prompt lengths, outputs and arrival offsets) and scored by the squared log
error of the cells' median TTFT and median ITL; Nelder-Mead (a few hundred evaluations of a
millisecond each) searches the coefficients in log space, so all stay positive. What the fit
predicts is exactly what the served simulator executes.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence

import numpy as np

from pdplane.plan.sweep import Cell, CellResult
from pdplane.sim.engine import EngineCore, EngineLimits, EngineRequest
from pdplane.sim.frontend import Frontend
from pdplane.sim.offline import run_offline
from pdplane.sim.profiles import CostModel, Profile

__all__ = ["FIT_FIELDS", "fit_cost", "predict", "unbatched_ttft_weight"]

#: CostModel fields the fit searches (others keep the base profile's value).
FIT_FIELDS = (
    "step_ms",
    "token_ms",
    "seq_ms",
    "kv_read_ms_per_ktok",
    "prefill_attn_ms_per_mpair",
    "request_ms",
)


def unbatched_ttft_weight(cell: Cell) -> float:
    """`fit_cost`'s `ttft_weight` for a sweep on a real instance: 0 for a cell of B > 1 requests
    sent at once, 1 otherwise (single requests, spread-out arrivals).

    A burst's TTFT holds the API server's serial handling of its B requests (parsing, the hop
    to the engine core) that the engine model has no term for; fitted, it inflates `token_ms`
    and `request_ms` and every lone request is then predicted late (vLLM CPU, tiny model:
    out-of-sample TTFT error 14-42 % with the bursts' TTFT, 2-25 % without; docs/plan.md).
    `bench/sim/calibrate.py` removes the same cost by measuring the served simulator's own
    (`overhead_s`). The bursts' ITL still counts: it carries the decode batch costs. Fitting
    the FIFO term `serial_request_ms` with the bursts' TTFT instead (pass it in `fields`)
    fits the bursts but predicted the lone out-of-sample cells worse in 6 of 7 rounds on vLLM
    CPU (docs/plan.md): vLLM lets a burst in nearly all at once, not first come first served.
    """
    return 0.0 if cell.batch > 1 and not cell.arrivals else 1.0


def predict(profile: Profile, cost: CostModel, cell: Cell, seed: int = 0) -> tuple[float, float]:
    """(median TTFT s, mean ITL s) of one cell on the engine model."""
    limits = EngineLimits(
        num_blocks=profile.num_blocks,
        block_size=profile.block_size,
        max_num_seqs=profile.max_num_seqs,
        max_num_batched_tokens=profile.max_num_batched_tokens,
    )
    core = EngineCore(limits, cost)
    frontend = Frontend(cost)
    arrivals: list[tuple[float, EngineRequest]] = []
    sent: dict[str, float] = {}
    base = 1_000_000 * (seed + 1)
    shared = list(range(base, base + cell.shared_prefix))
    offset = 0.0
    if cell.shared_prefix:
        arrivals.append((frontend.admit(0.0), EngineRequest("warm", [*shared, 1], [1])))
        offset = 10.0  # long after the warm-up finished
    sends = sorted(
        (offset + (cell.arrivals[i] if cell.arrivals else 0.0), i) for i in range(cell.batch)
    )
    for at, i in sends:  # in arrival order: the API server is a FIFO
        own = base + (i + 1) * 100_000
        prompt = shared + list(range(own, own + cell.prompt - cell.shared_prefix))
        sent[f"r{i}"] = at
        arrivals.append((frontend.admit(at), EngineRequest(f"r{i}", prompt, [1] * cell.output)))
    run = run_offline(core, arrivals)
    # TTFT from when the request was sent (the engine saw it after the API server let it in).
    ttfts = [t.token_times[0] - sent[k] for k, t in run.timings.items() if k != "warm"]
    itls = [x for k, t in run.timings.items() if k != "warm" for x in t.itls]
    return statistics.median(ttfts), statistics.fmean(itls) if itls else float("nan")


def _first_guess(targets: list[tuple[Cell, float, float]]) -> dict[str, float]:
    """Coefficients read off the single-request and pure-decode cells (ms), as a start."""
    ones = sorted((c.prompt, ttft, itl) for c, ttft, itl in targets if c.batch == 1)
    guess: dict[str, float] = {}
    if not ones:
        return guess
    itl1 = ones[0][2] * 1e3
    guess["step_ms"] = 0.9 * itl1
    if len(ones) > 1 and ones[-1][0] > ones[0][0]:
        per_token = (ones[-1][1] - ones[0][1]) * 1e3 / (ones[-1][0] - ones[0][0])
        guess["token_ms"] = max(per_token, 1e-5)
        guess["request_ms"] = max(ones[0][1] * 1e3 - itl1 - per_token * ones[0][0], 0.01)
    lone = {c.prompt: t for c, t, _ in targets if c.batch == 1 and not c.shared_prefix}
    bursts = [(c, t) for c, t, _ in targets if c.batch > 1 and not c.arrivals and c.prompt in lone]
    if bursts:
        # Half of the biggest burst's extra median TTFT over a lone request's, as the API
        # server's FIFO (the median request of B waits (B + 1) / 2 turns); the engine's batch
        # has the other half.
        c, t = max(bursts, key=lambda b: b[0].batch)
        turns = (c.batch + 1) / 2
        guess["serial_request_ms"] = max(0.5 * (t - lone[c.prompt]) * 1e3 / turns, 0.01)
    big = max((c for c, _, _ in targets), key=lambda c: c.batch)
    itl_big = next(i for c, _, i in targets if c == big) * 1e3
    if big.batch > 1:
        guess["seq_ms"] = max((itl_big - itl1) / (big.batch - 1), 1e-4)
    return guess


def _nelder_mead(
    f: Callable[[np.ndarray], float], x0: np.ndarray, step: float = 0.7, iters: int = 400
) -> np.ndarray:
    n = len(x0)
    simplex = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        centroid = np.mean(simplex[:-1], axis=0)
        worst = simplex[-1]
        reflected = centroid + (centroid - worst)
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2 * (centroid - worst)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (worst - centroid)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                best = simplex[0]
                simplex = [best + 0.5 * (x - best) for x in simplex]
                values = [f(x) for x in simplex]
    return simplex[int(np.argmin(values))]


def fit_cost(
    profile: Profile,
    measured: Sequence[CellResult],
    *,
    fields: Sequence[str] = FIT_FIELDS,
    iters: int = 400,
    overhead_s: dict[str, float] | None = None,
    ttft_weight: Callable[[Cell], float] | None = None,
) -> tuple[CostModel, float]:
    """The cost model minimising the cells' squared log errors; returns it and its score.

    `overhead_s` (per cell name) is the served simulator's own latency on top of the model
    (HTTP, measured with the zero profile): a cell's predicted TTFT is the model's plus it, so
    the fitted `request_ms` is vLLM's request overhead minus the simulator's.
    `ttft_weight(cell)` scales a cell's TTFT term (default 1; the ITL term keeps weight 1).
    `fields` may add `serial_request_ms` (not in `FIT_FIELDS`: started from the bursts'
    extra TTFT over a lone request's).
    """
    weight = ttft_weight or (lambda _cell: 1.0)
    extra = overhead_s or {}
    base = profile.cost
    targets = [(r.cell, r.ttft, r.itl) for r in measured if r.ttft_s]
    start = {f: max(getattr(base, f), 1e-6) for f in fields}
    start.update({k: v for k, v in _first_guess(targets).items() if k in start})

    def cost_of(x: np.ndarray) -> CostModel:
        values = {f: float(math.exp(v)) for f, v in zip(fields, x, strict=True)}
        return dataclasses.replace(base, **values)

    def score(x: np.ndarray) -> float:
        cost = cost_of(x)
        total = 0.0
        for cell, ttft, itl in targets:
            p_ttft, p_itl = predict(profile, cost, cell)
            total += weight(cell) * math.log((p_ttft + extra.get(cell.name, 0.0)) / ttft) ** 2
            if not math.isnan(itl) and not math.isnan(p_itl) and itl > 0 and p_itl > 0:
                total += math.log(p_itl / itl) ** 2
        return total

    x0 = np.array([math.log(start[f]) for f in fields])
    best = _nelder_mead(score, x0, iters=iters)
    return cost_of(best), score(best)
