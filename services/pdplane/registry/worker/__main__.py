"""A registry worker process (started by `pdplane registry --workers N`, never by hand).

Reads its configuration as one JSON object on stdin (`{"settings": RegistrySettings,
"store": "unix:PATH", "port": N}`: the tokens travel there, never on argv), serves
`pdplane.v1.Registry` (+ health, reflection, the same auth and TLS) on `host:port` with
SO_REUSEPORT beside its sibling workers, prints `ready PORT` and serves until SIGTERM or until
the process that started it is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from typing import Any

import grpc

from pdplane.core.grpc import util as grpc_util
from pdplane.registry.servicer import SERVICE_NAME
from pdplane.registry.settings import RegistrySettings
from pdplane.registry.worker.batcher import HeartbeatBatcher
from pdplane.registry.worker.servicer import ForwardingServicer
from pdplane.v1 import registry_pb2_grpc
from pdplane.v1 import registry_workers_pb2_grpc as workers_pb2_grpc

__all__ = ["main"]

#: How often the worker looks whether the process that started it is still there (s).
_PARENT_CHECK_S = 0.5
#: The control-plane server options, except that worker servers share the port (the kernel
#: spreads connections over them); gRPC takes the first of two values of an option.
_OPTIONS = [
    ("grpc.so_reuseport", 1),
    *(option for option in grpc_util.SERVER_OPTIONS if option[0] != "grpc.so_reuseport"),
]


async def _serve(settings: RegistrySettings, store: str, port: int) -> None:
    parent = os.getppid()
    channel = grpc_util.aio_channel(store)
    metadata = grpc_util.token_metadata(settings.token)
    batcher = HeartbeatBatcher(workers_pb2_grpc.RegistryWorkersStub(channel), metadata)
    server = grpc.aio.server(
        interceptors=grpc_util.aio_server_interceptors(settings.token, settings.admin_token),
        options=_OPTIONS,
    )
    registry_pb2_grpc.add_RegistryServicer_to_server(
        ForwardingServicer(registry_pb2_grpc.RegistryStub(channel), batcher), server
    )
    await grpc_util.aio_add_health_and_reflection(server, [SERVICE_NAME])
    bound = grpc_util.add_port(
        server, f"{settings.host}:{port}", settings.tls_cert, settings.tls_key
    )
    carrying = asyncio.create_task(batcher.run())
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print(f"ready {bound}", flush=True)
    while not stop.is_set() and os.getppid() == parent:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), _PARENT_CHECK_S)
    await server.stop(0.5)
    carrying.cancel()
    await channel.close()


def main() -> int:
    """Serves until stopped; 0 after a clean stop, 2 on a bad configuration."""
    try:
        config: dict[str, Any] = json.loads(sys.stdin.readline())
        settings = RegistrySettings.model_validate(config["settings"])
        store, port = str(config["store"]), int(config["port"])
    except (ValueError, KeyError, TypeError) as exc:
        sys.stderr.write(f"pdplane registry worker: bad configuration: {exc}\n")
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # SIGINT from a terminal reaches the whole process group: the parent stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    asyncio.run(_serve(settings, store, port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
