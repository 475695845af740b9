"""Several schedulers (or embedded-mode gateways) over one fleet: how evenly a burst lands.

The scenario of `tests/support/replicas.py` (2 prefill + 4 decode sims, decodes 1-3 already running
40 streams each, a burst of 120 split across the gateways), run side by side for each variant;
prints where the burst landed, the total decode load and its max/mean, and the ratio of each
variant's max/mean to the single shared scheduler's (the reference: every assignment counted
in one place).

    .venv/bin/python bench/scheduler/replicas.py                # every variant, 3 runs each
    (variants without a policy use the schedulers' default; "-ll" least_loaded, "-p2"
    power_of_two on both sides)
    .venv/bin/python bench/scheduler/replicas.py --runs 5 --variants remote-shared,remote-alone
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from tests.support import replicas as scenario

#: name -> run() keywords
VARIANTS: dict[str, dict[str, Any]] = {
    "one-scheduler": {"mode": "shared"},
    "remote-alone": {"mode": "remote", "share": False},
    "remote-shared": {"mode": "remote", "share": True},
    "embedded-alone": {"mode": "embedded", "share": False},
    "embedded-shared": {"mode": "embedded", "share": True},
    "remote-ll-alone": {"mode": "remote", "share": False, "policy": "least_loaded"},
    "remote-ll-shared": {"mode": "remote", "share": True, "policy": "least_loaded"},
    "remote-p2-alone": {"mode": "remote", "share": False, "policy": "power_of_two"},
    "embedded-ll-shared": {"mode": "embedded", "share": True, "policy": "least_loaded"},
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--heartbeat-ms", type=int, default=1000)
    args = parser.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    medians: dict[str, float] = {}
    print(f"{'variant':<18} {'run':>3}  {'burst per decode':<20} {'totals':<20} max/mean  s")
    for name in names:
        ratios = []
        for run in range(args.runs):
            r = scenario.run(heartbeat_ms=args.heartbeat_ms, **VARIANTS[name])
            ratios.append(r.max_over_mean)
            print(
                f"{name:<18} {run:>3}  {r.burst!s:<20} {r.totals!s:<20} "
                f"{r.max_over_mean:8.3f}  {r.seconds:.2f}"
                + (f"  failed {len(r.failed)}" if r.failed else ""),
                flush=True,
            )
        medians[name] = statistics.median(ratios)
    base = medians.get("one-scheduler")
    print()
    for name, m in medians.items():
        vs = f"  x{m / base:.3f} of one-scheduler" if base else ""
        print(f"{name:<18} median max/mean {m:.3f}{vs}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
