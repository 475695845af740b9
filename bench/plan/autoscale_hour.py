"""The autoscaling controller against a static split, a reactive rule and an oracle, in a
modelled hour (virtual time: `pdplane.autoscale.proof`, docs/plan.md "Autoscaling in the
simulator").

    python bench/autoscale_hour.py --gpus 8 16 --seeds 0 1 [--profile llama3-8b-h100] \\
        [--jobs 3] [--out logs/autoscale-hour]

Every budget serves the same hour (the 8-GPU cap binds where the traffic needs more). Every
policy of one (budget, seed) serves the same requests from
the same start (the static split, `pdplane plan`'s recommendation for the hour's average).
Runs are independent processes (`--jobs`); the result does not depend on how many. Prints one
Markdown table (per budget and policy: SLO attainment over 1-minute windows, goodput,
GPU-hours, moves, unfinished requests) and writes it with each run's moves and failed windows
to OUT/autoscale-hour.md and OUT/autoscale-hour.json; each run's details also go to
OUT/run-GPUS-SEED-POLICY.json as soon as it ends.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from pdplane.autoscale.elastic import ElasticSettings
from pdplane.autoscale.predictor import Bounds
from pdplane.autoscale.proof import POLICIES, Row, hour, requests_of, run_policies, static_split
from pdplane.autoscale.proof import table as render_table
from pdplane.plan.search import parse_slo
from pdplane.sim.profiles import load_profile


def _start(profile: str, slo: str, gpus: int, seed: int) -> tuple[int, int]:
    bounds = Bounds(max_prefill=gpus - 1, max_decode=gpus - 1, gpus=gpus)
    reqs = requests_of(hour(), seed)
    return static_split(load_profile(profile), parse_slo(slo), reqs, bounds, seed)


def _run(
    profile: str, slo: str, gpus: int, seed: int, policy: str, start: tuple[int, int], out: Path
) -> Row:
    t0 = time.process_time()
    (row,) = run_policies(
        load_profile(profile),
        parse_slo(slo),
        hour(),
        ElasticSettings(gpus=gpus),
        seed=seed,
        policies=[policy],
        start=start,
    )
    r = row.result
    sys.stderr.write(
        f"gpus {gpus} seed {seed} {policy}: attainment {r.attainment:.0%}, goodput "
        f"{r.goodput:.2f} req/s, {r.gpu_hours:.2f} GPU-h, {len(r.moves)} moves, "
        f"{r.unfinished} unfinished ({time.process_time() - t0:.0f} s CPU)\n"
    )
    # Each run is kept as it ends: a long sitting cut short keeps what it finished.
    (out / f"run-{gpus}-{seed}-{policy}.json").write_text(json.dumps(_details(row), indent=1))
    return row


def _details(row: Row) -> dict[str, object]:
    r = row.result
    return {
        "policy": row.policy,
        "seed": row.seed,
        "gpus": row.gpus,
        "start": f"{row.start[0]}P{row.start[1]}D",
        "attainment": r.attainment,
        "goodput_rps": r.goodput,
        "gpu_hours": r.gpu_hours,
        "moves": [(round(t), str(m)) for t, m in r.moves],
        "timeline": [(round(t), label) for t, label in r.timeline],
        "failed_windows": [
            (round(w.start), round(w.ttft_p90_s, 3), round(w.itl_p90_s * 1e3, 1))
            for w in r.windows
            if not w.met
        ],
        "unfinished": r.unfinished,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--slo", default="ttft_p90<=1s,itl_p90<=50ms")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--jobs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("logs/autoscale-hour"))
    args = ap.parse_args()
    cells = [(g, s) for g in args.gpus for s in args.seeds]
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with ProcessPoolExecutor(args.jobs) as pool:
        found = [pool.submit(_start, args.profile, args.slo, g, s) for g, s in cells]
        starts = {cell: f.result() for cell, f in zip(cells, found, strict=True)}
        jobs = [
            pool.submit(_run, args.profile, args.slo, g, s, p, starts[g, s], args.out)
            for g, s in cells
            for p in args.policies
        ]
        rows = [j.result() for j in jobs]
    text = render_table(rows)
    sys.stdout.write(text)
    (args.out / "autoscale-hour.md").write_text(text)
    data = {"profile": args.profile, "slo": args.slo, "runs": [_details(r) for r in rows]}
    (args.out / "autoscale-hour.json").write_text(json.dumps(data, indent=1))
    sys.stderr.write(f"{time.monotonic() - t0:.0f} s wall\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
