"""grpcurl-style tools work: reflection lists the services, health answers SERVING."""

from __future__ import annotations

from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from pdplane.core import grpc_util
from pdplane.registry.server import RegistryServer
from tests.integration.registry.fixtures import running_registry


def test_reflection_lists_registry_and_health(registry: RegistryServer) -> None:
    with grpc_util.channel(registry.address) as chan:
        services = set(ProtoReflectionDescriptorDatabase(chan).get_services())
        assert {"pdplane.v1.Registry", "grpc.health.v1.Health"} <= services
        db = ProtoReflectionDescriptorDatabase(chan)
        proto_file = db.FindFileContainingSymbol("pdplane.v1.Registry")
        assert proto_file.name == "pdplane/v1/registry.proto"
        assert [m.name for m in proto_file.service[0].method] == [
            "Register",
            "Heartbeat",
            "HeartbeatStream",
            "Deregister",
            "ListInstances",
            "GetInstance",
            "WatchInstances",
        ]


def test_health_serving_even_with_a_token() -> None:
    with running_registry(token="t") as addr, grpc_util.channel(addr) as chan:
        stub = health_pb2_grpc.HealthStub(chan)
        for service in ("", "pdplane.v1.Registry"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
