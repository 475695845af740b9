"""grpcurl-style tools work: reflection (v1 and v1alpha) lists the services, health answers
SERVING and says which process answered."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.descriptor_pb2 import FileDescriptorProto
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from pdplane.core.grpc import util as grpc_util
from pdplane.core.server_id import server_id
from pdplane.launch.process import grpc_serving
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
            "HeartbeatBatchStream",
            "Deregister",
            "ListInstances",
            "ListInstancesStream",
            "GetInstance",
            "WatchInstances",
        ]


def test_health_serving_even_with_a_token() -> None:
    with running_registry(token="t") as addr, grpc_util.channel(addr) as chan:
        stub = health_pb2_grpc.HealthStub(chan)
        for service in ("", "pdplane.v1.Registry"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _v1_reflection(chan: grpc.Channel, request: reflection_pb2.ServerReflectionRequest) -> Any:
    # grpc.reflection.v1 has the v1alpha messages under another package: same bytes on the wire.
    call = chan.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    return next(iter(call(iter([request]), timeout=5)))


def test_reflection_v1_answers_like_v1alpha(registry: RegistryServer) -> None:
    with grpc_util.channel(registry.address) as chan:
        listed = _v1_reflection(chan, reflection_pb2.ServerReflectionRequest(list_services=""))
        names = {s.name for s in listed.list_services_response.service}
        assert {
            "pdplane.v1.Registry",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= names
        for symbol, file_name in (
            ("pdplane.v1.Registry", "pdplane/v1/registry.proto"),
            ("grpc.reflection.v1.ServerReflection", "grpc/reflection/v1/reflection.proto"),
        ):
            found = _v1_reflection(
                chan, reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
            )
            protos = found.file_descriptor_response.file_descriptor_proto
            assert file_name in {FileDescriptorProto.FromString(b).name for b in protos}


def test_health_answers_carry_the_server_id(registry: RegistryServer) -> None:
    with grpc_util.channel(registry.address) as chan:
        _, call = health_pb2_grpc.HealthStub(chan).Check.with_call(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    assert dict(call.initial_metadata())["pdplane-server-id"] == server_id()
    assert grpc_serving(registry.address, server_id=server_id())
    assert not grpc_serving(registry.address, server_id="another-process")
