"""The autoscaling controller against a static split, a reactive rule and an oracle, in a
modelled hour (virtual time: `pdplane.autoscale.proof`, docs/plan.md "Autoscaling in the
simulator").

    python bench/plan/autoscale_hour.py --gpus 8 16 --seeds 0 1 2 [--profile llama3-8b-h100] \\
        [--mean-gpus N] [--inflight-budget F] [--jobs 3] [--out logs/autoscale-hour]

Every budget serves the same hour (the 8-GPU cap binds where the traffic needs more). Every
policy of one (budget, seed) serves the same requests from the same start (the static split,
`pdplane plan`'s recommendation for the hour's average). Every run (budget x seed x policy)
is an independent process (`--jobs` at once; a run starts as soon as its budget and seed's
static split is known); the result does not depend on how many. The controller's spend target
(`--mean-gpus`, docs/autoscale.md) is by default what the static split holds: the controller
is judged at no more GPU-hours than static; `--mean-gpus 0` runs it without one.
`--inflight-budget F` puts the gateway's flow control in front of every policy's fleet
(`pdplane.autoscale.elastic`: the gateway's `--inflight-budget`, 1.0 by default there, and
its `--queue-timeout-s` 60 s): requests past the budget wait at the gateway and an overload
is shed (429) instead of queueing on the prefills without bound; default 0 (none).

Written as it goes, to OUT: each static split to start-GPUS-SEED.json and each run's details
(summary, moves, fleet timeline, failed windows, the controller's decisions with their
reasons) to run-GPUS-SEED-POLICY.json as soon as it ends, with the table of the runs finished
so far in autoscale-hour.md. A second call with the same OUT, profile, SLO and spend target
reuses what is there and runs only what is missing (delete OUT to start over). At the end it
prints the Markdown table (per budget and policy: SLO attainment over 1-minute windows,
goodput, GPU-hours, moves, unfinished and shed requests) and writes it to
OUT/autoscale-hour.md, with every run's details in OUT/autoscale-hour.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench._args import at_least
from pdplane.autoscale.controller import ControllerSettings
from pdplane.autoscale.elastic import ElasticSettings
from pdplane.autoscale.predictor import Bounds
from pdplane.autoscale.proof import (
    POLICIES,
    Row,
    Summary,
    hour,
    requests_of,
    run_policies,
    static_split,
    table,
)
from pdplane.plan.search import parse_slo
from pdplane.sim.profiles import load_profile

Cell = tuple[int, int]  # (GPU budget, seed)


def _start(profile: str, slo: str, gpus: int, seed: int) -> tuple[int, int]:
    bounds = Bounds(max_prefill=gpus - 1, max_decode=gpus - 1, gpus=gpus)
    reqs = requests_of(hour(), seed)
    return static_split(load_profile(profile), parse_slo(slo), reqs, bounds, seed)


def _run(
    profile: str,
    slo: str,
    gpus: int,
    seed: int,
    policy: str,
    start: tuple[int, int],
    mean_gpus: float | None,
    inflight_budget: float,
) -> dict[str, Any]:
    t0 = time.process_time()
    (row,) = run_policies(
        load_profile(profile),
        parse_slo(slo),
        hour(),
        ElasticSettings(gpus=gpus, inflight_budget=inflight_budget),
        seed=seed,
        policies=[policy],
        start=start,
        mean_gpus=mean_gpus,
    )
    details = _details(row)
    details["cpu_s"] = round(time.process_time() - t0)
    return details


def _details(row: Row) -> dict[str, Any]:
    r = row.result
    return {
        "summary": asdict(Summary.of(row)),
        "moves": [(round(t), str(m)) for t, m in r.moves],
        "shed": r.shed,
        "timeline": [(round(t), label) for t, label in r.timeline],
        "failed_windows": [
            (round(w.start), round(w.ttft_p90_s, 3), round(w.itl_p90_s * 1e3, 1))
            for w in r.windows
            if not w.met
        ],
        "decisions": [(round(t), line) for t, line in row.decisions],
    }


def _summary(details: dict[str, Any]) -> Summary:
    s = dict(details["summary"])
    s["start"] = tuple(s["start"])
    s.setdefault("shed", details.get("shed", 0))  # a run written before the column
    return Summary(**s)


class _Out:
    """OUT's files: what a run needs to be skipped on the next call, written as it ends."""

    def __init__(
        self, folder: Path, profile: str, slo: str, mean_gpus: float | None, budget: float
    ) -> None:
        self.folder = folder
        # A file counts only for the same profile, SLO, controller defaults, spend target and
        # gateway model.
        self.key = {
            "profile": profile,
            "slo": slo,
            "mean_gpus": "static" if mean_gpus is None else mean_gpus,
            "controller": asdict(ControllerSettings()),
            "elastic": asdict(ElasticSettings(inflight_budget=budget)),
        }
        folder.mkdir(parents=True, exist_ok=True)

    def _read(self, name: str) -> dict[str, Any] | None:
        path = self.folder / name
        if not path.exists():
            return None
        data: dict[str, Any] = json.loads(path.read_text())
        return data if data.get("key") == self.key else None

    def _write(self, name: str, data: dict[str, Any]) -> None:
        tmp = self.folder / f".{name}.tmp"
        tmp.write_text(json.dumps({"key": self.key, **data}, indent=1))
        tmp.replace(self.folder / name)  # whole or absent, even when the sitting is cut short

    def start(self, cell: Cell) -> tuple[int, int] | None:
        data = self._read(f"start-{cell[0]}-{cell[1]}.json")
        return (data["prefill"], data["decode"]) if data else None

    def put_start(self, cell: Cell, split: tuple[int, int]) -> None:
        self._write(f"start-{cell[0]}-{cell[1]}.json", {"prefill": split[0], "decode": split[1]})

    def run(self, cell: Cell, policy: str) -> dict[str, Any] | None:
        return self._read(f"run-{cell[0]}-{cell[1]}-{policy}.json")

    def put_run(self, cell: Cell, policy: str, details: dict[str, Any]) -> None:
        self._write(f"run-{cell[0]}-{cell[1]}-{policy}.json", details)


def _report(details: dict[str, Any]) -> None:
    s = _summary(details)
    sys.stderr.write(
        f"gpus {s.gpus} seed {s.seed} {s.policy}: attainment {s.attainment:.0%}, goodput "
        f"{s.goodput:.2f} req/s, {s.gpu_hours:.2f} GPU-h, {s.moves} moves, "
        f"{s.unfinished} unfinished, {s.shed} shed ({details['cpu_s']} s CPU)\n"
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0].replace("\n", " "),
    )
    ap.add_argument(
        "--gpus",
        type=at_least(2, int),
        nargs="+",
        default=[8, 16],
        help="GPU budgets (one instance per GPU, at least 2: 1P1D; default 8 16)",
    )
    ap.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], help="traffic seeds (default 0 1 2)"
    )
    ap.add_argument(
        "--profile", default="llama3-8b-h100", help="engine profile (default llama3-8b-h100)"
    )
    ap.add_argument(
        "--slo",
        default="ttft_p90<=1s,itl_p90<=50ms",
        help="the SLO judged (default ttft_p90<=1s,itl_p90<=50ms)",
    )
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument(
        "--mean-gpus",
        type=at_least(0, float),
        default=None,
        help="the controller's spend target, mean GPUs (default: what the static split holds; "
        "0: none)",
    )
    ap.add_argument(
        "--inflight-budget",
        type=at_least(0, float),
        default=0.0,
        help="the gateway's flow control in front of the fleet: its --inflight-budget (default 0: "
        "none)",
    )
    ap.add_argument(
        "--jobs", type=at_least(1, int), default=3, help="runs at once (processes; default 3)"
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=Path("logs/autoscale-hour"),
        help="results (default logs/autoscale-hour)",
    )
    args = ap.parse_args()
    out = _Out(args.out, args.profile, args.slo, args.mean_gpus, args.inflight_budget)
    cells: list[Cell] = [(g, s) for g in args.gpus for s in args.seeds]
    done: dict[tuple[Cell, str], dict[str, Any]] = {}
    for cell in cells:
        for p in args.policies:
            if (found := out.run(cell, p)) is not None:
                done[cell, p] = found
    if done:
        sys.stderr.write(f"{len(done)} runs found in {args.out}; running the rest\n")
    t0 = time.monotonic()
    with ProcessPoolExecutor(args.jobs) as pool:
        pending: dict[Future[Any], tuple[Cell, str | None]] = {}

        def submit_runs(cell: Cell, split: tuple[int, int]) -> None:
            for p in args.policies:
                if (cell, p) not in done:
                    f = pool.submit(
                        _run,
                        args.profile,
                        args.slo,
                        *cell,
                        p,
                        split,
                        args.mean_gpus,
                        args.inflight_budget,
                    )
                    pending[f] = (cell, p)

        for cell in cells:
            if all((cell, p) in done for p in args.policies):
                continue
            if (split := out.start(cell)) is not None:
                submit_runs(cell, split)
            else:
                pending[pool.submit(_start, args.profile, args.slo, *cell)] = (cell, None)
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                cell, policy = pending.pop(f)
                if policy is None:
                    out.put_start(cell, f.result())
                    submit_runs(cell, f.result())
                    continue
                details = f.result()
                out.put_run(cell, policy, details)
                done[cell, policy] = details
                _report(details)
                (args.out / "autoscale-hour.md").write_text(
                    table([_summary(d) for d in done.values()])
                )
    ordered = [done[cell, p] for cell in cells for p in args.policies]
    text = table([_summary(d) for d in ordered])
    sys.stdout.write(text)
    (args.out / "autoscale-hour.md").write_text(text)
    data = {"profile": args.profile, "slo": args.slo, "runs": ordered}
    (args.out / "autoscale-hour.json").write_text(json.dumps(data, indent=1))
    sys.stderr.write(f"{time.monotonic() - t0:.0f} s wall\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
