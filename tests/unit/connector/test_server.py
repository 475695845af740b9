"""The worker's gRPC server hosts any set of services next to each other."""

from __future__ import annotations

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdplane.connector.holds import HoldTable
from pdplane.connector.kv_cache import KvCacheView
from pdplane.connector.server import HoldAccess, start_kv_server, worker_services
from pdplane.connector.transports.base import ServiceBinding
from pdplane.connector.transports.tcp import TcpTransport
from pdplane.core.grpc import util as grpc_util
from pdplane.v1 import instance_pb2, scheduler_pb2, scheduler_pb2_grpc


def _status(channel: grpc.Channel, name: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status


def test_another_service_is_hosted_beside_the_transports() -> None:
    layout = instance_pb2.KvLayout(num_layers=1, block_size=4, dtype="float32")
    transport = TcpTransport()
    transport.bind(KvCacheView({"l0": torch.zeros(4, 8)}))
    extra = ServiceBinding(
        "pdplane.v1.Scheduler",
        lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(
            scheduler_pb2_grpc.SchedulerServicer(), s
        ),
    )
    services = [*worker_services(transport, HoldAccess(HoldTable(), layout)), extra]
    assert [s.name for s in services] == [
        "pdplane.v1.KvTransfer",
        "pdplane.v1.TcpKvTransfer",
        "pdplane.v1.Scheduler",
    ]
    server = start_kv_server(services, "127.0.0.1:0", ready=False)
    try:
        with grpc_util.channel(f"127.0.0.1:{server.port}") as channel:
            serving = health_pb2.HealthCheckResponse.SERVING
            assert _status(channel, "pdplane.v1.TcpKvTransfer") == serving
            assert _status(channel, "pdplane.v1.Scheduler") == serving
            # readiness (what registration waits for) starts as asked, then flips
            assert _status(channel, "pdplane.v1.KvTransfer") != serving
            server.set_ready(True)
            assert _status(channel, "pdplane.v1.KvTransfer") == serving
            with pytest.raises(grpc.RpcError) as err:  # hosted: its own handler answers
                scheduler_pb2_grpc.SchedulerStub(channel).Schedule(
                    scheduler_pb2.ScheduleRequest(), timeout=5
                )
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert "not implemented" in (err.value.details() or "").lower()
    finally:
        server.stop(0)
