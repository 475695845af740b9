"""An in-process gateway for tests and benchmarks: `running_gateway(...)`.

Example::

    with running_gateway(scheduler_address, registry_address, max_retries=2) as url:
        httpx.post(f"{url}/v1/completions", json={...})

The gateway runs under uvicorn (uvloop + httptools, as `pdplane gateway`) on its own event loop
in a background thread, bound to 127.0.0.1 on a free port.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI

from pdplane.gateway.app import create_app
from pdplane.gateway.fleet_view import FleetView
from pdplane.gateway.http_server import server_options
from pdplane.gateway.settings import GatewaySettings
from pdplane.scheduler import SchedulerPort

__all__ = ["running_gateway", "running_gateway_app"]

_START_TIMEOUT_S = 30.0


@contextmanager
def running_gateway(
    scheduler: str = "",
    registry: str = "",
    *,
    scheduler_port: SchedulerPort | None = None,
    fleet: Callable[[], FleetView] | None = None,
    **settings: Any,
) -> Iterator[str]:
    """Serves a gateway for the block; yields its base URL "http://127.0.0.1:<port>".

    `scheduler`/`registry` are gRPC addresses (`scheduler="embedded"` decides in-process);
    `scheduler_port`/`fleet` replace the real clients (unit tests). Keywords are
    `GatewaySettings` fields. Raises RuntimeError when the server does not start within 30 s.
    On exit the server shuts down and its thread is joined.
    """
    with running_gateway_app(
        scheduler, registry, scheduler_port=scheduler_port, fleet=fleet, **settings
    ) as (url, _app):
        yield url


@contextmanager
def running_gateway_app(
    scheduler: str = "",
    registry: str = "",
    *,
    scheduler_port: SchedulerPort | None = None,
    fleet: Callable[[], FleetView] | None = None,
    **settings: Any,
) -> Iterator[tuple[str, FastAPI]]:
    """`running_gateway`, yielding (base URL, the app) so that tests can read `app.state`."""
    config = GatewaySettings.model_validate(
        {
            **({"scheduler": scheduler} if scheduler else {}),
            **({"registry": registry} if registry else {}),
            "host": "127.0.0.1",
            "port": 0,
            **settings,
        }
    )
    app = create_app(config, scheduler=scheduler_port, fleet=fleet)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            loop="uvloop",
            **server_options(config),
            log_level="warning",
            access_log=False,
            proxy_headers=False,
            lifespan="on",
        )
    )
    thread = threading.Thread(target=server.run, name="pdplane-gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            thread.join(_START_TIMEOUT_S)
            raise RuntimeError("gateway did not start")
        time.sleep(0.01)
    try:
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(_START_TIMEOUT_S)
