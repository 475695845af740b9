"""A registry stopped under open streams logs no errors."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import grpc
import pytest

from pdplane.core.grpc import util as grpc_util
from pdplane.launch.ports import free_port_run
from pdplane.v1 import registry_pb2, registry_pb2_grpc
from tests.integration.registry.fixtures import make_spec, running_registry_server


def _open_heartbeat_stream(stub: registry_pb2_grpc.RegistryStub) -> threading.Event:
    """Registers "p0" through `stub` and keeps a HeartbeatStream of it open (answered once)
    until the returned event is set."""
    lease = stub.Register(registry_pb2.RegisterRequest(spec=make_spec("p0")))
    done = threading.Event()

    def heartbeats() -> Iterator[registry_pb2.HeartbeatRequest]:
        yield registry_pb2.HeartbeatRequest(instance_id="p0", lease_id=lease.lease_id)
        done.wait(30)

    next(stub.HeartbeatStream(heartbeats()))  # the stream is open on the server
    return done


def test_stopping_under_open_watch_and_heartbeat_streams_logs_no_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # gRPC cancels the calls still open when the grace ends; stopped too early, the loop
    # cancelled gRPC's own task of each call, which logged an ERROR with a CancelledError
    # traceback per stream ("Exception not handled by _handle_exceptions").
    caplog.set_level(logging.INFO)
    with running_registry_server(lease_ttl_ms=30_000) as server:
        chan = grpc_util.channel(server.address)
        stub = registry_pb2_grpc.RegistryStub(chan)
        watch = stub.WatchInstances(registry_pb2.WatchInstancesRequest())
        assert next(watch).type == registry_pb2.WatchEvent.SNAPSHOT
        beats = _open_heartbeat_stream(stub)
    beats.set()
    with pytest.raises(grpc.RpcError):
        for _ in watch:  # the events sent before the stop, then the stream's end
            pass
    chan.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


def test_a_relay_stopped_by_sigterm_under_open_heartbeat_streams_logs_no_error() -> None:
    # `pdplane registry-relay` as its own process (the path of a real SIGTERM: asyncio.run
    # ends the loop right after the relay stopped).
    with running_registry_server(lease_ttl_ms=30_000) as server:
        port = free_port_run()
        argv = [sys.executable, "-m", "pdplane.cli.main", "registry-relay"]
        argv += ["--registry", server.address, "--host", "127.0.0.1", "--port", str(port)]
        relay = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
        try:
            chan = grpc_util.channel(f"127.0.0.1:{port}")
            grpc.channel_ready_future(chan).result(timeout=30)
            stub = registry_pb2_grpc.RegistryStub(chan)
            beats = _open_heartbeat_stream(stub)
            try:
                relay.send_signal(signal.SIGTERM)
                assert relay.wait(timeout=30) == 0
            finally:
                beats.set()
        finally:
            relay.kill()
            chan.close()
        stderr = relay.stderr.read() if relay.stderr else ""
    assert "ERROR" not in stderr and "CancelledError" not in stderr, stderr
