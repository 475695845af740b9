"""Calibration: the same workload on real vLLM and on `pdplane sim`; the error of TTFT and ITL.

    python bench/sim/calibrate.py --fit --out logs/calib   # CPU
    python bench/sim/calibrate.py --target gpu --out $OUT/sim_profile     # GPU machine
    python bench/sim/calibrate.py --target cpu-dummy --fit --out logs/calib-dry  # GPU dry run

`--target cpu` (default): vLLM CPU with `pdplane.models.tiny` against the sim's `tiny-cpu`
profile (or `--profile FILE.json`), both pinned to `--engine-cores`, the client on
`--client-cores`. `--fit` first fits the cost model to the vLLM measurements
(pdplane.plan.fit) and uses the fit. `--target gpu` (bench/sim/gpu_profile.sh runs it)
serves a Llama-3-8B-shaped model with dummy weights (bench/sim/calib_servers.py), always fits, and
writes the measured profile `profile-llama3-8b-<gpu>.json` (`pdplane sim --profile FILE`) next
to the error table. Starts vLLM: on the CPU machine run it when nothing else loads it.

Cells: B concurrent requests x L-token prompts x O output tokens (token-id prompts, unique: no
prefix hits) are fitted; a shared-prefix cell and a Poisson-arrival cell are out of sample.
Errors are |sim - vLLM| / vLLM of each cell's median TTFT and mean ITL; the summary gives their
medians over the cells. Files: calibration-vllm.json (the vLLM side, written as soon as it is
measured), the fitted profile, calibration.json and calibration.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import ROOT
from bench.sim.calib_servers import MODEL, cache_config, start_sim, start_vllm, stop
from pdplane.plan.fit import fit_cost, predict
from pdplane.plan.sweep import Cell, CellResult, measure_cells, mixed_arrivals
from pdplane.sim.profiles import PROFILES, CostModel, Profile, load_profile

CPU_GRID = [Cell(b, n, 32) for b in (1, 4, 16) for n in (64, 256, 768)]
CPU_HOLDOUT = [
    Cell(1, 768, 32, shared_prefix=640),
    Cell(24, 256, 32, arrivals=mixed_arrivals(24, 20.0, 1)),
]
GPU_GRID = [Cell(b, n, 64) for b in (1, 16, 64) for n in (256, 1024, 4096)]
GPU_HOLDOUT = [
    Cell(1, 4096, 64, shared_prefix=3584),
    Cell(64, 1024, 128, arrivals=mixed_arrivals(64, 16.0, 1)),
]


def _result(d: dict[str, Any]) -> CellResult:
    c = d["cell"]
    cell = Cell(c["batch"], c["prompt"], c["output"], c["shared_prefix"], tuple(c["arrivals"]))
    return CellResult(cell, d["ttft_s"], d["itl_s"], d["errors"])


def _err(sim: float, real: float) -> float:
    return abs(sim - real) / real if real and not math.isnan(sim) else float("nan")


def report(
    real: list[CellResult], sim: list[CellResult], holdout: set[str]
) -> tuple[str, dict[str, Any]]:
    """Markdown table and the summary (median errors in and out of sample)."""
    lines = [
        "| cell | vLLM TTFT ms | sim TTFT ms | err | vLLM ITL ms (mean) | sim ITL ms | err |",
        "|---|---|---|---|---|---|---|",
    ]
    errs: dict[str, list[float]] = {k: [] for k in ("ttft_fit", "itl_fit", "ttft_out", "itl_out")}
    for r, s in zip(real, sim, strict=True):
        et, ei = _err(s.ttft, r.ttft), _err(s.itl, r.itl)
        kind = "out" if r.cell.name in holdout else "fit"
        errs[f"ttft_{kind}"].append(et)
        errs[f"itl_{kind}"].append(ei)
        mark = " (out of sample)" if kind == "out" else ""
        lines.append(
            f"| {r.cell.name}{mark} | {r.ttft * 1e3:.1f} | {s.ttft * 1e3:.1f} | {et:.0%} | "
            f"{r.itl * 1e3:.2f} | {s.itl * 1e3:.2f} | {ei:.0%} |"
        )
    summary: dict[str, Any] = {k: statistics.median(v) if v else None for k, v in errs.items()}
    every = [x for v in errs.values() for x in v if not math.isnan(x)]
    summary["all"] = statistics.median(every) if every else None
    shown = ", ".join(f"{k} {v:.1%}" for k, v in summary.items() if v is not None)
    lines += ["", f"median error: {shown}"]
    return "\n".join(lines), summary


def _measure_vllm(args: argparse.Namespace, cells: list[Cell], work: Path) -> tuple[Any, Any]:
    if args.measured:
        earlier = json.loads(args.measured.read_text())
        return earlier["cache_config"], [_result(d) for d in earlier["real"]]
    t0 = time.time()
    proc, url = start_vllm(
        args.target, work, cores=args.engine_cores, gpu_util=args.gpu_util, eager=args.eager
    )
    print(f"vLLM ready in {time.time() - t0:.0f} s", flush=True)
    try:
        cache = cache_config(url)
        real = asyncio.run(measure_cells(url, MODEL, cells, repeats=args.repeats))
    finally:
        stop(proc)
        (args.out / "vllm.log").write_bytes((work / "vllm.log").read_bytes())
    side = {"cache_config": cache, "real": [r.to_dict() for r in real]}
    (args.out / "calibration-vllm.json").write_text(json.dumps(side))
    print(f"vLLM measured, {time.time() - t0:.0f} s in all", flush=True)
    return cache, real


def _fit(
    args: argparse.Namespace, base: Profile, grid: list[Cell], real: list[CellResult], work: Path
) -> Path:
    # The simulator's own HTTP latency per cell (zero-time steps), so the fit does not count it
    # twice: the fitted request_ms is vLLM's request overhead minus the simulator's.
    zero_path = work / "zero-time.json"
    zero_path.write_text(json.dumps(dataclasses.replace(base, cost=CostModel()).to_dict()))
    proc, url = start_sim(str(zero_path), args.engine_cores, work)
    try:
        zero = asyncio.run(measure_cells(url, MODEL, grid, repeats=1))
    finally:
        stop(proc)
    overhead = {r.cell.name: r.ttft for r in zero}
    t0 = time.time()
    cost, score = fit_cost(base, [r for r in real if r.cell in grid], overhead_s=overhead)
    gpu = args.target == "gpu"
    stem = f"llama3-8b-{args.gpu_name}" if gpu else args.target.replace("cpu", "tiny-cpu", 1)
    when = time.strftime("%Y-%m-%d")
    fitted = dataclasses.replace(
        base,
        name=f"{stem}-measured",
        cost=cost,
        sources=(
            f"measured: bench/sim/calibrate.py --target {args.target} {when}, fit score "
            f"{score:.3f} over {len(grid)} cells",
        ),
    )
    path = args.out / f"profile-{stem}.json"
    path.write_text(json.dumps(fitted.to_dict(), indent=1))
    print(f"fitted in {time.time() - t0:.0f} s (score {score:.3f}): {cost} -> {path}", flush=True)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--target", choices=("cpu", "gpu", "cpu-dummy"), default="cpu")
    ap.add_argument(
        "--gpu", action="store_const", const="gpu", dest="target", help="= --target gpu"
    )
    ap.add_argument("--gpu-name", default="h200", help="names the fitted GPU profile")
    ap.add_argument("--gpu-util", type=float, default=0.9, help="--gpu-memory-utilization")
    ap.add_argument("--eager", action="store_true", help="GPU: --enforce-eager (no CUDA graphs)")
    ap.add_argument("--fit", action="store_true", help="fit the cost model first (gpu: always)")
    ap.add_argument(
        "--profile", default="", help="sim profile (default: the fit, else the target's named one)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine-cores", default="0", help="CPU targets: cores of vLLM and the sim")
    ap.add_argument("--client-cores", default="1", help="CPU targets: cores of the load client")
    ap.add_argument("--out", type=Path, default=ROOT / "logs" / "calib")
    ap.add_argument("--measured", type=Path, help="reuse an earlier calibration-vllm.json")
    args = ap.parse_args(argv)
    gpu = args.target == "gpu"
    if gpu:
        args.engine_cores = args.client_cores = ""
    args.out.mkdir(parents=True, exist_ok=True)
    if args.client_cores:
        os.sched_setaffinity(0, {int(c) for c in args.client_cores.split(",")})
    grid, hold = (GPU_GRID, GPU_HOLDOUT) if gpu else (CPU_GRID, CPU_HOLDOUT)
    base = PROFILES["llama3-8b-h200" if gpu else "tiny-cpu"]
    work = Path(tempfile.mkdtemp(prefix="pdplane-calib-"))
    cache, real = _measure_vllm(args, grid + hold, work)
    blocks = cache.get("num_gpu_blocks", "")
    if blocks.isdigit():  # the sim gets vLLM's real capacity
        block_size = int(cache.get("block_size") or base.block_size)
        base = dataclasses.replace(base, num_blocks=int(blocks), block_size=block_size)
    if args.target == "cpu-dummy":
        base = dataclasses.replace(base, max_num_seqs=128, max_num_batched_tokens=2048)
    profile = args.profile
    if not profile and (args.fit or gpu):
        profile = str(_fit(args, base, grid, real, work))
    profile = profile or base.name
    proc, url = start_sim(profile, args.engine_cores, work)
    try:
        sim = asyncio.run(measure_cells(url, MODEL, grid + hold, repeats=args.repeats))
    finally:
        stop(proc)
    used = load_profile(profile)
    table, summary = report(real, sim, {c.name for c in hold})
    offline = [predict(used, used.cost, r.cell) for r in real]
    result = {
        "target": args.target,
        "profile": used.to_dict(),
        "cache_config": cache,
        "summary": summary,
        "real": [r.to_dict() for r in real],
        "sim": [s.to_dict() for s in sim],
        "offline": [{"ttft_median_s": a, "itl_mean_s": b} for a, b in offline],
    }
    (args.out / "calibration.json").write_text(json.dumps(result, indent=1))
    (args.out / "calibration.md").write_text(f"profile {used.name}\n\n{table}\n")
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
