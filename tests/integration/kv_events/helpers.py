"""What the KV-events integration tests share: an engine's KvEventLog on its own gRPC server,
token lists and a wait."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from concurrent import futures

import grpc

from pdplane.core.grpc import util as grpc_util
from pdplane.core.kv_events.log import KvEventLog
from pdplane.core.kv_events.servicer import StreamOptions, add_kv_events_servicer
from pdplane.v1 import instance_pb2

#: Tokens per KV block of the engines here.
BS = 16
#: The bearer token the engines' servers require.
TOKEN = "tok"


class Engine:
    """A KvEventLog on its own gRPC server, like a connector's or a simulator's."""

    def __init__(self, name: str, heartbeat_s: float = 0.2) -> None:
        self.name = name
        self.log = KvEventLog()
        self.heartbeat_s = heartbeat_s
        self.server: grpc.Server | None = None
        self.port = 0
        self.start()

    def start(self, port: int = 0) -> None:
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4),
            interceptors=[grpc_util.TokenAuthInterceptor(TOKEN)],
            options=grpc_util.SERVER_OPTIONS,
        )
        add_kv_events_servicer(server, self.log, StreamOptions(heartbeat_s=self.heartbeat_s))
        self.port = grpc_util.add_port(server, f"127.0.0.1:{port or self.port}")
        server.start()
        self.server = server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(None)
            self.server = None

    def instance(self) -> instance_pb2.Instance:
        return instance_pb2.Instance(
            spec=instance_pb2.InstanceSpec(
                instance_id=self.name, kv_endpoint=f"127.0.0.1:{self.port}", model="tiny"
            )
        )

    def store(self, tokens: list[int]) -> None:
        n = len(tokens) // BS
        hashes = [hash((self.name, tuple(tokens[: (i + 1) * BS]))) & (2**64 - 1) for i in range(n)]
        self.log.stored(hashes, None, tokens[: n * BS], BS)


def tokens(seed: int, blocks: int) -> list[int]:
    """`blocks` blocks' worth of random token ids, the same for the same `seed`."""
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(blocks * BS)]


def waited(cond: Callable[[], bool], timeout: float = 10.0) -> float:
    """Seconds until `cond()` held (polled every 10 ms); fails after `timeout` s."""
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.01)
    return time.monotonic() - start
