"""Sequential vs concurrent dispatch of the pdplane gateway, at long prompts, by concurrency.

Both modes over the same fleet (a fresh one per point): `concurrency` closed-loop clients
(no think time) send streamed chat requests of `isl` prompt tokens and 64 output tokens for
`--duration` modelled seconds. Per point: TTFT p50 / p99, requests per second, gateway CPU per
request; the table puts the modes side by side with their TTFT ratio. The routing benchmark
(bench/routing/routing.py) hands in its base point and its `started` (fleet and router up):
this module imports nothing of it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.routing.openloop import closed_loop
from tests.support.stats import percentile

__all__ = ["Started", "run_study"]

#: `started(point, logs, proxy_cpus, sim_cpus)`: the point's fleet and router up, yielding
#: (router, fleet line); bench/routing/routing.py's `started`.
Started = Callable[[Any, Path, str, str], AbstractContextManager[tuple[Any, dict[str, Any]]]]


def _point(
    base: Any, isl: int, conc: int, dispatch: str, logs: Path, args: Any, started: Started
) -> dict[str, Any]:
    p = replace(base, dispatch=dispatch, row="pdplane:least_loaded")
    with started(p, logs, args.proxy_cpus, args.sim_cpus) as (proxy, _line):
        cpu0 = proxy.cpu_ms()
        outs = asyncio.run(
            closed_loop(
                proxy.url + "/v1/chat/completions",
                concurrency=conc,
                duration_s=p.duration_s,
                prompt_tokens=isl,
                max_tokens=64,
                time_scale=p.time_scale,
            )
        )
        ok = [o for o in outs if o.ok]
        return {
            "point": asdict(p),
            "isl": isl,
            "concurrency": conc,
            "dispatch": dispatch,
            "requests": len(ok),
            "errors": len(outs) - len(ok),
            "rps": len(ok) / p.duration_s,
            "ttft_p50_ms": percentile([o.ttft for o in ok], 50) * 1e3,
            "ttft_p99_ms": percentile([o.ttft for o in ok], 99) * 1e3,
            "gateway_cpu_ms_per_request": (proxy.cpu_ms() - cpu0) / max(len(ok), 1),
        }


def run_study(
    args: argparse.Namespace, out: Path, base: Any, started: Started
) -> list[dict[str, Any]]:
    """Every (isl, concurrency, mode) point from the `base` point (a routing Point: topology,
    duration, profile, time scale); prints a Markdown table and returns the rows."""
    rows: list[dict[str, Any]] = []
    for isl in (1000, 8000):  # "1k" and "8k" (8000 + 64 output tokens fit 8192)
        for conc in (8, 16, 32, 64, 128):
            for mode in ("sequential", "concurrent"):
                print(
                    f"[dispatch {mode}] isl {isl} concurrency {conc}", file=sys.stderr, flush=True
                )
                t0 = time.perf_counter()
                rows.append(_point(base, isl, conc, mode, out / "logs", args, started))
                print(
                    f"  {rows[-1]['ttft_p50_ms']:.1f} ms p50, {rows[-1]['rps']:.1f} req/s "
                    f"({time.perf_counter() - t0:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    lines = [
        "| ISL | streams | seq TTFT p50 / p99 ms | conc TTFT p50 / p99 ms | conc/seq p50 "
        "| seq / conc req/s | gateway CPU ms/req seq / conc |",
        "|---|---|---|---|---|---|---|",
    ]
    for i in range(0, len(rows), 2):
        s, c = rows[i], rows[i + 1]
        lines.append(
            f"| {s['isl']} | {s['concurrency']} | {s['ttft_p50_ms']:.1f} / {s['ttft_p99_ms']:.1f} "
            f"| {c['ttft_p50_ms']:.1f} / {c['ttft_p99_ms']:.1f} "
            f"| {c['ttft_p50_ms'] / s['ttft_p50_ms']:.3f} | {s['rps']:.1f} / {c['rps']:.1f} "
            f"| {s['gateway_cpu_ms_per_request']:.2f} / {c['gateway_cpu_ms_per_request']:.2f} |"
        )
    table = "\n".join(lines)
    (out / "dispatch.md").write_text(table + "\n")
    print(table)
    return rows
