"""`pdplane profile` against real vLLM CPU: does the measured profile predict the instance?

    python bench/plan/plan_profile.py --out logs/plan-profile

Starts one vLLM CPU instance (`pdplane.models.tiny`, the launcher's lean settings, pinned to
`--engine-cores`), runs `pdplane profile` against it (client on `--client-cores`), then
measures the calibration's out-of-sample cells (a shared-prefix cell and Poisson arrivals,
bench/sim/calibrate.py) on the same instance and prints, side by side, the engine model's
error with the profile `pdplane profile` wrote and with the named `tiny-cpu` profile (the
simulator's own calibration): median |model - vLLM| / vLLM of each cell's median TTFT and
mean ITL, in and out of sample; then the fit's A/B, all refitted on the re-measured sweep
cells: without the API server's serial term and the burst cells' TTFT left out (what `pdplane
profile` does), with the term and every cell's TTFT fitted, with the term and the bursts' TTFT
at 1/4 weight. Writes profile.json, plan-profile.md and
plan-profile.json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import ROOT
from bench.sim.calibrate import CPU_HOLDOUT
from pdplane.launch.ports import free_port_run
from pdplane.launch.vllm_cpu import VllmCpuInstance, VllmCpuOptions
from pdplane.models.tiny import build_tiny_model
from pdplane.plan import profile_cli
from pdplane.plan.fit import FIT_FIELDS, fit_cost, predict, unbatched_ttft_weight
from pdplane.plan.sweep import Cell, CellResult, measure_cells
from pdplane.sim.profiles import PROFILES, Profile, load_profile

MODEL = "tiny"


def _errors(profile: Profile, real: list[CellResult]) -> tuple[float, float]:
    et, ei = [], []
    for r in real:
        ttft, itl = predict(profile, profile.cost, r.cell)
        et.append(abs(ttft - r.ttft) / r.ttft)
        ei.append(abs(itl - r.itl) / r.itl)
    return statistics.median(et), statistics.median(ei)


def _quarter_bursts(cell: Cell) -> float:
    return 1.0 if unbatched_ttft_weight(cell) else 0.25


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "logs" / "plan-profile")
    ap.add_argument("--engine-cores", default="0")
    ap.add_argument("--client-cores", default="1")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    os.sched_setaffinity(0, {int(c) for c in args.client_cores.split(",")})
    work = Path(tempfile.mkdtemp(prefix="pdplane-plan-profile-"))
    tiny = PROFILES["tiny-cpu"]
    opts = VllmCpuOptions(
        model=build_tiny_model(work / "models"),
        port=free_port_run(),
        served_model_name=MODEL,
        max_model_len=tiny.max_model_len,
        num_gpu_blocks=tiny.num_blocks,
        omp_threads_bind=args.engine_cores,
    )
    inst = VllmCpuInstance(opts, log_path=args.out / "vllm.log")
    t0 = time.monotonic()
    inst.start()
    try:
        inst.wait_healthy(300)
        print(f"vLLM ready in {time.monotonic() - t0:.0f} s", flush=True)
        path = args.out / "profile.json"
        t1 = time.monotonic()
        rc = profile_cli.main(
            ["--url", inst.url, "--out", str(path), "--repeats", str(args.repeats)]
        )
        took = time.monotonic() - t1
        if rc:
            return rc
        holdout = asyncio.run(measure_cells(inst.url, MODEL, CPU_HOLDOUT, repeats=args.repeats))
        # the fitted cells again, so both profiles are scored on the same measurements
        grid = asyncio.run(
            measure_cells(inst.url, MODEL, profile_cli.GRIDS["cpu"], repeats=args.repeats)
        )
    finally:
        inst.stop()
    measured = load_profile(str(path))
    # A/B of the fit's TTFT weighting, both fitted on the re-measured sweep cells (so their
    # sweep-cell column is in sample) from the same start as `pdplane profile`.
    start = dataclasses.replace(measured, cost=tiny.cost)
    variants = (
        ("no serial term, burst TTFT left out (now)", FIT_FIELDS, unbatched_ttft_weight),
        ("serial term, burst TTFT fitted", (*FIT_FIELDS, "serial_request_ms"), None),
        ("serial term, burst TTFT at 1/4", (*FIT_FIELDS, "serial_request_ms"), _quarter_bursts),
    )
    refits = {
        f"refit, {kind}": dataclasses.replace(
            start, cost=fit_cost(start, grid, fields=fields, ttft_weight=weight)[0]
        )
        for kind, fields, weight in variants
    }
    rows = []
    result: dict[str, object] = {"profile_s": took, "profile": measured.to_dict()}
    profiles = {"pdplane profile": measured, "tiny-cpu (calibration)": tiny, **refits}
    for label, prof in profiles.items():
        fit_t, fit_i = _errors(prof, grid)
        out_t, out_i = _errors(prof, holdout)
        result[label] = {"ttft_fit": fit_t, "itl_fit": fit_i, "ttft_out": out_t, "itl_out": out_i}
        rows.append(f"| {label} | {fit_t:.1%} | {fit_i:.1%} | {out_t:.1%} | {out_i:.1%} |")
    table = "\n".join(
        [
            f"pdplane profile took {took:.0f} s ({len(profile_cli.GRIDS['cpu'])} cells x "
            f"{args.repeats}); cost {measured.cost}",
            "",
            "| profile | TTFT err (sweep cells) | ITL err (sweep cells) | TTFT err (out of sample)"
            " | ITL err (out of sample) |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    (args.out / "plan-profile.md").write_text(table + "\n")
    (args.out / "plan-profile.json").write_text(json.dumps(result, indent=1))
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
