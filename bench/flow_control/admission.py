"""A full fleet with and without the gateway's admission queue, side by side (sims, loopback).

    .venv/bin/python bench/flow_control/admission.py [--requests 48] [--concurrency 16]
        [--kv-blocks 20] [--rounds 2]

One registry, one sim prefill and one sim decode whose KV cache holds `kv_blocks` blocks of 128
tokens (a request of 401 prompt + 16 output tokens takes 4-5), a gateway with the scheduler
embedded; streamed completions `concurrency` at a time. Per round, first the queue off
(`--queue-timeout-s 0`: 503 at once, as before) then on (the default), the same requests each.
Prints per variant completed requests, 503s, wall time, and the ratio on / off.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

from pdplane.gateway.testing import running_gateway_app
from pdplane.registry.server import RegistryServer
from pdplane.registry.settings import RegistrySettings
from pdplane.sim.testing import running_sims
from tests.support.loadgen import completion_burst

_MODEL = "sim-model"
_BODY = {"model": _MODEL, "prompt": "word " * 400, "max_tokens": 16, "stream": True}


def _run(args: argparse.Namespace, registry: str, queue_timeout_s: float) -> tuple[int, int, float]:
    with running_gateway_app(
        "embedded", registry, registry_wait_s=5.0, queue_timeout_s=queue_timeout_s
    ) as (url, app):
        service = app.state.scheduler.service
        deadline = time.monotonic() + 10
        while not (
            len(service.view.candidates(_MODEL)) == 2
            and all(c.total_kv_blocks for c in service.view.candidates(_MODEL))
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the sims' load reports did not reach the gateway")
            time.sleep(0.02)
        started = time.perf_counter()
        statuses = asyncio.run(
            completion_burst(url, _BODY, args.requests, args.concurrency, timeout_s=120)
        )
        wall = time.perf_counter() - started
    return statuses[200], statuses[-503], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--kv-blocks", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    config = RegistrySettings.model_validate(
        {"host": "127.0.0.1", "port": 0, "lease_ttl_ms": 2000, "heartbeat_interval_ms": 200}
    )
    registry = RegistryServer(config)
    registry.start()
    with contextlib.ExitStack() as exits:
        exits.callback(registry.stop, 0.2)
        exits.enter_context(
            running_sims(
                ["prefill", "decode"],
                registry=registry.address,
                model=_MODEL,
                kv_blocks=args.kv_blocks,
                block_size=128,
                itl_ms=10,
                max_model_len=1024,
            )
        )
        print(
            f"{args.requests} streams, {args.concurrency} at a time, decode of "
            f"{args.kv_blocks} x 128-token blocks"
        )
        print("round  variant      completed  503  wall s  wall on/off")
        for n in range(1, args.rounds + 1):
            ok_off, u_off, wall_off = _run(args, registry.address, 0.0)
            ok_on, u_on, wall_on = _run(args, registry.address, 60.0)
            print(f"{n:5}  queue off    {ok_off:9}  {u_off:3}  {wall_off:6.2f}")
            print(
                f"{n:5}  queue on     {ok_on:9}  {u_on:3}  {wall_on:6.2f}  {wall_on / wall_off:.2f}"
            )


if __name__ == "__main__":
    main()
