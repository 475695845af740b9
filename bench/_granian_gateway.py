"""The gateway app under granian (Rust HTTP/1 server, ASGI interface) instead of uvicorn.

For the relay benchmark's `+granian` / `+w2` variants only: an A/B of the client-facing HTTP
server with the same app. Measured, granian cost more gateway CPU per request than uvicorn
(docs/benchmarks.md), so `pdplane gateway` keeps uvicorn and this stays a benchmark launcher.

    python -m bench._granian_gateway [--granian-workers N] <pdplane gateway flags>

granian forks its worker processes; each builds its own app from the flags (its own scheduler
port, registry view and upstream pool). The header deadline maps to granian's
`http1_header_read_timeout`; granian has no keep-alive idle bound of its own and no 503 past a
connection cap (`backpressure` holds extra requests back instead).
"""

from __future__ import annotations

import sys
from typing import Any

from granian.constants import HTTPModes, Interfaces, Loops
from granian.http import HTTP1Settings
from granian.log import LogLevels
from granian.server import Server

from pdplane.gateway.settings import GatewaySettings

__all__ = ["serve"]

#: granian's longest header read timeout (ms); its option refuses more.
_MAX_HEADER_TIMEOUT_MS = 60_000


def serve(settings: GatewaySettings, workers: int = 1) -> None:
    """Serves the gateway app for `settings` under granian with `workers` processes."""
    header_ms = min(max(1, round(settings.header_timeout_s * 1000)), _MAX_HEADER_TIMEOUT_MS)
    server = Server(
        "pdplane.gateway.app:create_app",
        address=settings.host,
        port=settings.port,
        interface=Interfaces.ASGI,
        workers=workers,
        loop=Loops.uvloop,
        http=HTTPModes.http1,
        websockets=False,
        http1_settings=HTTP1Settings(header_read_timeout=header_ms, keep_alive=True),
        backpressure=settings.max_client_connections or None,
        log_level=LogLevels(settings.log_level),
        log_access=False,
        workers_kill_timeout=settings.shutdown_timeout_s or None,
    )

    def load_app(_target: str) -> Any:
        # Runs in each forked worker.
        from pdplane.core import tracing
        from pdplane.gateway.app import create_app

        tracing.configure("pdplane-gateway")
        return create_app(settings)

    server.serve(target_loader=load_app)


def main(argv: list[str]) -> int:
    workers = 1
    if argv[:1] == ["--granian-workers"]:
        workers, argv = int(argv[1]), argv[2:]
    settings = GatewaySettings.parse(argv)
    if workers > 1 and settings.embedded_scheduler:
        # Each worker would be its own embedded scheduler: two decisions over one fleet.
        print("--granian-workers > 1 needs a remote --scheduler", file=sys.stderr)
        return 2
    serve(settings, workers)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
