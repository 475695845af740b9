"""`pdplane sim`: run K simulated vLLM instances in one process until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys

from pdplane.core import tracing
from pdplane.core.listen import refuse_taken
from pdplane.sim.settings import SimSettings
from pdplane.sim.sim_fleet import SimFleet, expand

__all__ = ["main"]


async def _serve(settings: SimSettings) -> None:
    fleet = SimFleet(
        expand(settings.sim_config(), settings.instances),
        registry=settings.registry,
        registry_token=settings.registry_token,
        lease_ttl_ms=settings.lease_ttl_ms,
    )
    await fleet.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        for sim in fleet.instances:
            # One JSON line per instance: scripts wait for these to know the sims are up.
            line = {
                "instance_id": sim.instance_id,
                "role": sim.config.role,
                "url": sim.url,
                "kv_endpoint": sim.kv_endpoint,
            }
            sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()
        await stop.wait()
    finally:
        await fleet.stop()


def _ports(settings: SimSettings) -> list[tuple[int, str]]:
    """(port, flag) of every port the fleet binds: `instances` consecutive ones per flag."""
    wanted: list[tuple[int, str]] = []
    for flag, first in (("--port", settings.port), ("--kv-port", settings.kv_port)):
        if first:
            wanted += [(first + i, flag) for i in range(settings.instances)]
    return wanted


def main(argv: list[str]) -> int:
    """Entry point of `pdplane sim`; returns the exit code (2 on bad flags or a port in use,
    1 when an instance fails to start)."""
    settings = SimSettings.parse(argv)
    if refuse_taken("pdplane sim", settings.host, _ports(settings)):
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    tracing.configure("pdplane-sim")
    run = asyncio.run
    if settings.uvloop:
        try:
            import uvloop

            run = uvloop.run
        except ImportError:
            pass
    try:
        run(_serve(settings))
    except OSError as exc:  # a port taken after the check above, an unknown --host
        sys.stderr.write(f"pdplane sim: cannot start: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
