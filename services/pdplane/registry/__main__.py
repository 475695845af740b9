"""`pdplane registry`: runs the registry service until SIGTERM or SIGINT."""

from __future__ import annotations

import gc
import logging
import signal
import sys
import threading

from pdplane.core.listen import refuse_taken
from pdplane.registry.server import RegistryServer
from pdplane.registry.settings import RegistrySettings
from pdplane.registry.store import StoreError

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """Serves the registry with settings from `argv` and `PDPLANE_*`; returns the exit code
    (0 after a clean stop on SIGTERM/SIGINT, 2 on bad flags or a port in use, 1 when the
    server cannot start otherwise)."""
    settings = RegistrySettings.parse(argv)
    if refuse_taken("pdplane registry", settings.host, [(settings.port, "--port")]):
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # The collector's oldest generation is traversed whole; with the default thresholds a
    # registry holding 10,000 instances (etcd store) paused 140-160 ms for it several times a
    # minute, which was its heartbeat p99. Young collections 14x rarer keep objects that die
    # by reference count (most of them) out of the old generation: p99 32-74 ms instead of
    # 114-165 (bench/registry/load.py --mode relay, one core).
    gc.set_threshold(10_000, 10, 10)
    server = RegistryServer(settings)
    try:
        server.start()
    except (RuntimeError, OSError, ValueError, StoreError) as exc:
        sys.stderr.write(f"pdplane registry: {exc}\n")
        return 1
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    # Woken every 0.2 s: the kernel may hand SIGTERM to a gRPC thread, and a main thread
    # blocked without a timeout would never run the handler Python keeps for it.
    while not stopping.wait(0.2):
        pass
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
