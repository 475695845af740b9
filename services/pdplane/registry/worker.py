"""A registry worker process: serves the registry's port beside the primary (`--workers N`).

Started by the primary (`pdplane.registry.workers.WorkerPool`) as
`python -m pdplane.registry.worker`, which reads one JSON line on stdin (`WorkerConfig`: the
registry's settings, the bound port and the primary's link socket), binds the same port
(SO_REUSEPORT: the kernel spreads the clients' connections over the processes), prints
`ready` and serves until stdin closes (the primary stopped or died) or SIGTERM.

A heartbeat costs a registry process ~100-140 us of CPU in gRPC Python's read and write of the
message, against ~10 us of store work (docs/benchmarks/registry.md), and one process's event
loop is one thread. A worker pays that per-message cost on its own core and sends the
heartbeats it read to the primary in batches (`RegistryLink.ApplyHeartbeats`: one message per
batch); every other call it forwards unchanged (`pdplane.registry.forward`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import sys
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from pydantic import BaseModel

from pdplane.core.grpc import util as grpc_util
from pdplane.core.grpc.reflection import V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME
from pdplane.registry.forward import ForwardingHandler, shapes
from pdplane.registry.settings import RegistrySettings
from pdplane.v1 import registry_link_pb2, registry_link_pb2_grpc, registry_pb2

__all__ = ["HEARTBEAT_STREAM", "HeartbeatBatcher", "WorkerConfig", "main"]

log = logging.getLogger(__name__)

HEARTBEAT_STREAM = "/pdplane.v1.Registry/HeartbeatStream"
#: Most heartbeats in one batch (a batch of 1,024 load reports is ~100 KiB).
MAX_BATCH = 1024
#: How long a batch collects heartbeats after its first (s): a link message costs each side
#: about what a heartbeat does, so a batch of one would double the work it exists to spread;
#: at 5,000 heartbeats/s a worker's batches hold ~25. Added to a heartbeat's answer at most.
BATCH_WINDOW_S = 0.005
#: The outcome of heartbeats whose batch was lost with the link: the client retries, as it
#: does when a registry goes away.
_LINK_LOST = registry_link_pb2.HeartbeatOutcome(
    code=grpc.StatusCode.UNAVAILABLE.value[0], details="registry worker lost its primary"
)
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class WorkerConfig(BaseModel):
    """What the primary tells a worker (one JSON line on its stdin; the tokens travel here, not
    on argv or in the environment)."""

    settings: dict[str, Any]
    port: int
    link: str  # "unix:/path" of the primary's private socket


class HeartbeatBatcher:
    """Sends the heartbeats of every stream this worker serves to the primary in batches, over
    one `ApplyHeartbeats` stream, and hands each its outcome.

    A batch goes out `BATCH_WINDOW_S` after its first heartbeat arrived, with every heartbeat
    that arrived meanwhile (at most `MAX_BATCH`; a full batch goes at once). Outcomes come back in order. If the link breaks, the heartbeats in flight
    are answered UNAVAILABLE (their clients retry) and the link is opened again.
    """

    def __init__(self, stub: registry_link_pb2_grpc.RegistryLinkStub, metadata: Any) -> None:
        self._stub = stub
        self._metadata = metadata
        self._pending: list[tuple[registry_pb2.HeartbeatRequest, asyncio.Future[Any]]] = []
        self._wake = asyncio.Event()
        self._in_flight: collections.deque[list[asyncio.Future[Any]]] = collections.deque()

    async def apply(
        self, request: registry_pb2.HeartbeatRequest
    ) -> registry_link_pb2.HeartbeatOutcome:
        """The primary's outcome for one heartbeat (UNAVAILABLE when the link broke)."""
        future: asyncio.Future[registry_link_pb2.HeartbeatOutcome] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending.append((request, future))
        self._wake.set()
        return await future

    async def run(self) -> None:
        """Keeps the link open and sends batches until cancelled."""
        while True:
            call = self._stub.ApplyHeartbeats(metadata=self._metadata)
            reader = asyncio.ensure_future(self._read(call))
            reader.add_done_callback(lambda _: self._wake.set())  # a broken link ends _send
            try:
                await self._send(call, reader)
            except (grpc.RpcError, asyncio.InvalidStateError, ConnectionError) as exc:
                log.warning("link to the registry primary broke (%s); reopening", exc)
            finally:
                reader.cancel()
                call.cancel()
                self._fail_in_flight()
            await asyncio.sleep(0.1)

    async def _send(self, call: Any, reader: asyncio.Future[None]) -> None:
        while not reader.done():
            await self._wake.wait()
            if len(self._pending) < MAX_BATCH:
                await asyncio.sleep(BATCH_WINDOW_S)
            self._wake.clear()
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            if self._pending:
                self._wake.set()
            self._in_flight.append([future for _, future in batch])
            await call.write(
                registry_link_pb2.HeartbeatBatch(heartbeats=[request for request, _ in batch])
            )
        reader.result()  # raises what ended the reader

    async def _read(self, call: Any) -> None:
        async for result in call:
            for future, outcome in zip(self._in_flight.popleft(), result.outcomes, strict=True):
                if not future.done():
                    future.set_result(outcome)
        raise ConnectionError("the primary ended the link")

    def _fail_in_flight(self) -> None:
        while self._in_flight:
            for future in self._in_flight.popleft():
                if not future.done():
                    future.set_result(_LINK_LOST)
        self._wake.set()  # what is pending goes on the next link


def _heartbeat_stream(batcher: HeartbeatBatcher) -> grpc.RpcMethodHandler:
    """HeartbeatStream served by a worker: each heartbeat answered with its batch's outcome;
    a refusal ends the stream with its status, as on the primary."""

    # A coroutine function (not a callable object): gRPC runs anything else on its thread pool.
    async def heartbeat_stream(_requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        while (request := await context.read()) is not grpc.aio.EOF:
            outcome = await batcher.apply(request)
            if outcome.code:
                context.set_code(_CODES.get(outcome.code, grpc.StatusCode.UNKNOWN))
                context.set_details(outcome.details)
                return
            await context.write(outcome.response)

    return grpc.stream_stream_rpc_method_handler(
        heartbeat_stream,
        request_deserializer=registry_pb2.HeartbeatRequest.FromString,
        response_serializer=registry_pb2.HeartbeatResponse.SerializeToString,
    )


def _forwarded_shapes() -> dict[str, tuple[bool, bool]]:
    """Every method the primary serves on the registry's port, with its streaming shape."""
    served = shapes(
        [
            registry_pb2.DESCRIPTOR.services_by_name["Registry"],
            health_pb2.DESCRIPTOR.services_by_name["Health"],
            reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
        ]
    )
    # Reflection is also served under its v1 name, with the same messages (core.grpc.reflection).
    v1alpha = f"/{V1ALPHA_SERVICE_NAME}/"
    served.update(
        {f"/{V1_SERVICE_NAME}/{m[len(v1alpha):]}": shape
         for m, shape in served.items() if m.startswith(v1alpha)}
    )
    return served


async def serve(config: WorkerConfig, stop: asyncio.Event) -> None:
    """Serves `config.port` until `stop` is set; prints `ready` once bound."""
    settings = RegistrySettings.model_validate(config.settings)
    link = grpc.aio.insecure_channel(config.link, options=grpc_util.CHANNEL_OPTIONS)
    batcher = HeartbeatBatcher(
        registry_link_pb2_grpc.RegistryLinkStub(link),
        grpc_util.token_metadata(settings.token),
    )
    heartbeat = _heartbeat_stream(batcher)
    server = grpc.aio.server(
        interceptors=grpc_util.aio_server_interceptors(settings.token, settings.admin_token),
        options=grpc_util.SHARED_PORT_SERVER_OPTIONS,
    )
    server.add_generic_rpc_handlers(
        [ForwardingHandler(link, _forwarded_shapes(), {HEARTBEAT_STREAM: heartbeat})]
    )
    grpc_util.add_port(
        server, f"{settings.host}:{config.port}", settings.tls_cert, settings.tls_key
    )
    sender = asyncio.ensure_future(batcher.run())
    await server.start()
    print("ready", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop(0.5)
        sender.cancel()
        await link.close()


async def _main(config: WorkerConfig) -> int:
    loop = asyncio.get_running_loop()
    logging.basicConfig(
        level=str(config.settings.get("log_level", "INFO")).upper(),
        format="%(asctime)s %(levelname)s %(name)s[worker]: %(message)s",
    )
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    # The primary holds our stdin open while it runs: end of file means it is gone.
    loop.add_reader(0, lambda: os.read(0, 4096) or stop.set())
    await serve(config, stop)
    return 0


def main() -> int:
    """Entry point of `python -m pdplane.registry.worker` (exit 0 after a stop)."""
    config = WorkerConfig.model_validate_json(sys.stdin.buffer.readline())
    return asyncio.run(_main(config))


if __name__ == "__main__":
    sys.exit(main())
