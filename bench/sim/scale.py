"""How many simulated instances one process hosts: start-up time and CPU per simulated token.

    python bench/sim/scale.py --instances 64 --rate 1.5 --duration 60

1. Start-up: `SimFleet.start()` of N instances in this process (HTTP + gRPC servers bound, no
   registry), timed; then the same N as one `pdplane sim --instances N` process, from spawn to
   its last readiness line (Python start-up and imports included).
2. Load: that process (pinned to `--sim-cpus`) serves N `both` instances, each sent its own
   Poisson stream (`--rate` per instance, ISL/OSL fixed) by this process (on `--client-cpus`):
   the load an instance of the 8P16D routing runs sees. Reported: the sim process's CPU time
   over the window (utime + stime from /proc) per generated token and as a fraction of one
   core, the engines' lag (time the event loop woke steps late), modelled TTFT and ITL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench import ROOT
from bench._procs import spawn
from bench.routing import workloads as wl
from bench.routing.openloop import replay
from pdplane.sim.config import SimConfig
from pdplane.sim.sim_fleet import SimFleet, expand
from pdplane.sim.stats import LogHistogram
from tests.support.stats import percentile


async def _startup_in_process(n: int, profile: str) -> float:
    fleet = SimFleet(expand(SimConfig.from_profile(profile, kv_events=False), n))
    t0 = time.perf_counter()
    await fleet.start()
    elapsed = time.perf_counter() - t0
    await fleet.stop()
    return elapsed


def _stats(urls: list[str]) -> list[dict[str, Any]]:
    return [json.load(urllib.request.urlopen(u + "/sim/stats", timeout=10)) for u in urls]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--instances", type=int, default=64)
    ap.add_argument("--rate", type=float, default=1.5, help="requests/s per instance")
    ap.add_argument("--isl", type=int, default=1000)
    ap.add_argument("--osl", type=int, default=200)
    ap.add_argument("--duration", type=float, default=60.0, help="s of load")
    ap.add_argument("--profile", default="qwen2-7b-a100")
    ap.add_argument("--stream-interval", type=int, default=16)
    ap.add_argument("--sim-cpus", default="1")
    ap.add_argument("--client-cpus", default="0")
    ap.add_argument("--out", type=Path, default=ROOT / "logs" / "bench" / "sim_scale.json")
    args = ap.parse_args(argv)
    if args.client_cpus:
        os.sched_setaffinity(0, {int(c) for c in args.client_cpus.split(",")})
    n = args.instances
    in_process = asyncio.run(_startup_in_process(n, args.profile))
    logs = args.out.parent
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cmd = [
        sys.executable,
        "-m",
        "pdplane.cli.main",
        "sim",
        "--role",
        "both",
        "--port",
        "0",
        "--instances",
        str(n),
        "--profile",
        args.profile,
        "--record-limit",
        "0",
        "--no-kv-events",
        "--stream-interval",
        str(args.stream_interval),
    ]
    proc = spawn("sim-scale", cmd, args.sim_cpus, logs, stdout_pipe=True)
    try:
        urls = [line["url"] for line in proc.read_json_lines(n)]
        cold = time.perf_counter() - t0
        works = [
            wl.poisson(
                args.rate,
                int(args.rate * args.duration),
                wl.Lengths(args.isl),
                wl.Lengths(args.osl),
                seed=i,
            )
            for i in range(n)
        ]
        before, cpu0, w0 = _stats(urls), proc.cpu_ms(), time.perf_counter()

        async def drive() -> list[Any]:
            runs = [
                replay(u + "/v1/chat/completions", w, stop_at_s=args.duration + 30)
                for u, w in zip(urls, works, strict=True)
            ]
            return [o for batch in await asyncio.gather(*runs) for o in batch]

        outcomes = asyncio.run(drive())
        after, cpu1, wall = _stats(urls), proc.cpu_ms(), time.perf_counter() - w0
    finally:
        proc.stop()
    tokens = sum(
        b["generation_tokens"] - a["generation_tokens"] for a, b in zip(before, after, strict=True)
    )
    lag = sum(b["lag_s"] - a["lag_s"] for a, b in zip(before, after, strict=True))
    itl = LogHistogram()
    for a, b in zip(before, after, strict=True):
        itl = itl.merge(LogHistogram.from_dict(b["itl"]).minus(LogHistogram.from_dict(a["itl"])))
    ok = [o for o in outcomes if o.ok]
    cpu_s = (cpu1 - cpu0) / 1e3
    result = {
        "instances": n,
        "startup_in_process_ms": in_process * 1e3,
        "startup_in_process_ms_per_instance": in_process * 1e3 / n,
        "startup_cold_process_s": cold,
        "requests_ok": len(ok),
        "requests": len(outcomes),
        "generated_tokens": tokens,
        "wall_s": wall,
        "sim_cpu_s": cpu_s,
        "sim_cpu_cores": cpu_s / wall,
        "sim_cpu_us_per_token": cpu_s / tokens * 1e6 if tokens else float("nan"),
        "lag_s_per_instance": lag / n,
        "ttft_p50_ms": percentile([o.ttft for o in ok], 50) * 1e3,
        "ttft_p99_ms": percentile([o.ttft for o in ok], 99) * 1e3,
        "itl_p50_ms": itl.quantile(0.5) * 1e3,
        "itl_p99_ms": itl.quantile(0.99) * 1e3,
        "tpot_mean_ms": statistics.fmean(o.tpot for o in ok if o.tokens > 1) * 1e3 if ok else 0,
        "args": vars(args) | {"out": str(args.out)},
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
