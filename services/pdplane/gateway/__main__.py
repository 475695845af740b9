"""`pdplane gateway`: settings -> app -> uvicorn."""

from __future__ import annotations

import logging
import sys

import uvicorn

from pdplane.core import tracing
from pdplane.core.listen import refuse_taken
from pdplane.gateway.app import create_app
from pdplane.gateway.http_server import server_options
from pdplane.gateway.settings import GatewaySettings

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """Runs the gateway until interrupted; returns the exit code (2 on bad flags or a port in
    use)."""
    settings = GatewaySettings.parse(argv)
    wanted = [(settings.port, "--port"), (settings.inflight_port, "--inflight-port")]
    if refuse_taken("pdplane gateway", settings.host, wanted):
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    tracing.configure("pdplane-gateway")
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        # "auto" takes uvloop (uvicorn[standard]) and falls back to asyncio where an image lacks
        # it; HTTP is httptools (also uvicorn[standard]) with a header deadline (http_server).
        loop="auto",
        **server_options(settings),
        log_level=settings.log_level,
        # uvicorn's access log is off: the gateway writes its own (--access-log), which says
        # where each request went; nothing then reads the X-Forwarded-* rewriting.
        access_log=False,
        proxy_headers=False,
        timeout_graceful_shutdown=settings.shutdown_timeout_s,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
