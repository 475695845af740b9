"""The autoscaling controller against a static split, a reactive rule and an oracle, in a
modelled hour (virtual time: `pdplane.autoscale.proof`, docs/autoscale.md).

    python bench/autoscale_hour.py --gpus 8 16 --seeds 0 1 [--profile llama3-8b-h100] \
        [--out logs/autoscale-hour]

The traffic is sized to the budget: rates x gpus / 16 (`pdplane.autoscale.proof.hour`'s
scale), so the 8-GPU fleet sees half the 16-GPU fleet's requests.

Prints one Markdown table (per budget and policy: SLO attainment over 1-minute windows,
goodput, GPU-hours, moves, unfinished requests) and writes it with each run's moves and failed
windows to OUT/autoscale-hour.md and OUT/autoscale-hour.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pdplane.autoscale.elastic import ElasticSettings
from pdplane.autoscale.predictor import Predictor
from pdplane.autoscale.proof import POLICIES, Row, hour, run_policies, table
from pdplane.plan.search import parse_slo
from pdplane.sim.profiles import load_profile


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--slo", default="ttft_p90<=1s,itl_p90<=50ms")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--out", type=Path, default=Path("logs/autoscale-hour"))
    args = ap.parse_args()
    profile = load_profile(args.profile)
    slo = parse_slo(args.slo)
    predictor = Predictor(profile, slo)  # shared: its answers depend on the traffic only
    rows: list[Row] = []
    t0 = time.process_time()
    for gpus in args.gpus:
        for seed in args.seeds:
            for policy in args.policies:
                rows += run_policies(
                    profile,
                    slo,
                    hour(scale=gpus / 16),
                    ElasticSettings(gpus=gpus),
                    seed=seed,
                    predictor=predictor,
                    policies=[policy],
                )
                r = rows[-1].result
                sys.stderr.write(
                    f"gpus {gpus} seed {seed} {policy}: attainment {r.attainment:.0%}, "
                    f"{r.gpu_hours:.2f} GPU-h, {len(r.moves)} moves "
                    f"({time.process_time() - t0:.0f} s CPU so far)\n"
                )
    text = table(rows)
    sys.stdout.write(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "autoscale-hour.md").write_text(text)
    data = {"profile": args.profile, "slo": args.slo, "runs": [_details(r) for r in rows]}
    (args.out / "autoscale-hour.json").write_text(json.dumps(data, indent=1))
    sys.stderr.write(f"{time.process_time() - t0:.0f} s CPU, {predictor.simulations} fleets\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
