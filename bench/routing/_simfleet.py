"""A whole XpYd fleet of sims in one process, plus a control endpoint and the oracle router.

    python bench/routing/_simfleet.py --prefill 8 --decode 16 --registry 127.0.0.1:8051 \
        --profile llama3-8b-h200 --time-scale 1 --stream-interval 16 [--router oracle]

Prints one JSON line `{"prefill": [urls], "decode": [urls], "control": url, "oracle": url}`
(`oracle`: the in-fleet router's URL, or null)
once everything serves, then runs until SIGTERM/SIGINT. Control routes (one call for all
instances, so a benchmark reads 24 engines without 24 requests):
- `GET /fleet/stats`: `{"wall_time", "instances": [{"instance_id", "role", "stats": ...}]}`
  (`stats` as `GET /sim/stats` of each instance);
- `POST /fleet/reset-peaks`: every engine's max running / waiting / KV usage restart from now
  (the start of a measurement window).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from typing import Any

from aiohttp import web

from bench.routing._oracle import ROUTERS, build_oracle_app
from pdplane.sim.config import SimConfig
from pdplane.sim.profiles import load_profile
from pdplane.sim.sim_fleet import SimFleet

__all__ = ["main"]


def _control_app(fleet: SimFleet) -> web.Application:
    async def stats(_request: web.Request) -> web.Response:
        rows = [
            {"instance_id": s.instance_id, "role": s.config.role, "stats": s.state.stats_snapshot()}
            for s in fleet.instances
        ]
        return web.json_response({"wall_time": time.time(), "instances": rows})

    async def reset_peaks(_request: web.Request) -> web.Response:
        for s in fleet.instances:
            s.state.reset_peaks()
        return web.json_response({"reset": len(fleet.instances)})

    app = web.Application()
    app.router.add_get("/fleet/stats", stats)
    app.router.add_post("/fleet/reset-peaks", reset_peaks)
    return app


async def _serve(args: argparse.Namespace) -> None:
    knobs: dict[str, Any] = {
        "time_scale": args.time_scale,
        "stream_interval": args.stream_interval,
        "kv_mode": args.kv_mode,
        "push_overflow": args.push_overflow,
        "record_limit": 0,
        "model": args.model,
        "kv_events": args.kv_events,
        "tokenizer": args.tokenizer,
    }
    for name in ("kv_blocks", "push_buffer_bytes", "max_num_seqs"):
        value = getattr(args, name)
        if value:
            knobs[name] = value

    prof = load_profile(args.profile) if args.profile else None
    if prof is not None:
        # A cache smaller than the profile's shortens the context (as vLLM would refuse a
        # longer one); every instance gets the same, or prefill and decode would not pair.
        smallest = min(b for b in (args.kv_blocks, args.decode_kv_blocks, prof.num_blocks) if b)
        knobs["max_model_len"] = min(prof.max_model_len, smallest * prof.block_size)

    def config(role: str) -> SimConfig:
        extra = dict(knobs)
        if role == "decode" and args.decode_kv_blocks:
            extra["kv_blocks"] = args.decode_kv_blocks
        if prof is not None:
            return SimConfig.from_profile(prof, role=role, **extra)
        return SimConfig(role=role, **extra)  # type: ignore[arg-type]

    configs = [config("prefill") for _ in range(args.prefill)]
    configs += [config("decode") for _ in range(args.decode)]
    fleet = SimFleet(configs, registry=args.registry, registry_token=args.registry_token)
    await fleet.start()
    runners: list[web.AppRunner] = []

    async def serve(app: web.Application) -> str:
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    line: dict[str, Any] = {
        "prefill": [s.url for s in fleet.instances if s.config.role == "prefill"],
        "decode": [s.url for s in fleet.instances if s.config.role == "decode"],
        "control": await serve(_control_app(fleet)),
        "oracle": await serve(build_oracle_app(fleet, args.router)) if args.router else None,
    }
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()
    try:
        await stop.wait()
    finally:
        for runner in runners:
            await runner.cleanup()
        await fleet.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--prefill", type=int, required=True)
    ap.add_argument("--decode", type=int, required=True)
    ap.add_argument("--registry", default=None)
    ap.add_argument("--registry-token", default=None)
    ap.add_argument("--profile", default="")
    ap.add_argument("--model", default="sim-model")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--stream-interval", type=int, default=1)
    ap.add_argument("--kv-mode", choices=("pull", "push"), default="pull")
    ap.add_argument("--push-overflow", choices=("pull", "recompute"), default="pull")
    ap.add_argument("--push-buffer-bytes", type=int, default=0)
    ap.add_argument("--kv-blocks", type=int, default=0, help="every instance's cache (blocks)")
    ap.add_argument("--decode-kv-blocks", type=int, default=0, help="decode instances' cache")
    ap.add_argument("--max-num-seqs", type=int, default=0)
    ap.add_argument("--tokenizer", default="")
    ap.add_argument("--no-kv-events", dest="kv_events", action="store_false")
    ap.add_argument(
        "--router",
        choices=ROUTERS,
        default=None,
        help="also serve an in-fleet router (bench/routing/_oracle.py)",
    )
    args = ap.parse_args(argv)
    try:
        import uvloop

        uvloop.run(_serve(args))
    except ImportError:
        asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
