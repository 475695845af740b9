"""`pdplane scheduler --registry ADDR [...]`: settings -> app -> serve until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from pdplane.core import tracing
from pdplane.core.listen import refuse_taken
from pdplane.scheduler.app import SchedulerApp
from pdplane.scheduler.settings import SchedulerSettings

log = logging.getLogger("pdplane.scheduler")


async def _serve(settings: SchedulerSettings) -> int:
    app = SchedulerApp(settings)
    try:
        address = await app.start()
    except (OSError, RuntimeError, ValueError) as exc:
        log.error("cannot start the scheduler: %s", exc)
        return 1
    log.info(
        "scheduler serving on %s (prefill %s, decode %s, registry %s, metrics port %s)",
        address,
        settings.prefill_policy,
        settings.decode_policy,
        settings.registry,
        app.metrics_port or "off",
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("scheduler stopping")
    await app.stop()
    return 0


def main(argv: list[str]) -> int:
    """Runs the scheduler until SIGINT/SIGTERM; returns the exit code (2 on bad flags or a port
    in use, 1 when it cannot start otherwise)."""
    settings = SchedulerSettings.parse(argv)
    wanted = [(settings.port, "--port"), (settings.metrics_port, "--metrics-port")]
    if refuse_taken("pdplane scheduler", settings.host, wanted):
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    tracing.configure("pdplane-scheduler")
    return asyncio.run(_serve(settings))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
