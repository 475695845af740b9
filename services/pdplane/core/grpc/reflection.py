"""Server reflection under both names clients ask for: `grpc.reflection.v1` and `v1alpha`.

grpcio-reflection serves only `grpc.reflection.v1alpha.ServerReflection`; grpcurl and newer
clients ask `grpc.reflection.v1.ServerReflection` first. The two protocols are the same
messages under another package name (identical field numbers and types), so v1 is served by
the v1alpha servicer with the v1alpha message classes doing the (identical) wire encoding, and
the v1 file descriptor — v1alpha's with the package renamed — is added to the descriptor pool so
that `describe grpc.reflection.v1.ServerReflection` answers too.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_grpc

__all__ = ["V1ALPHA_SERVICE_NAME", "V1_SERVICE_NAME", "enable_reflection"]

V1ALPHA_SERVICE_NAME: str = reflection.SERVICE_NAME
V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
_V1_PACKAGE = "grpc.reflection.v1"
_V1_FILE = "grpc/reflection/v1/reflection.proto"
_METHOD = "ServerReflectionInfo"


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    file = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(file)
    old = f".{file.package}."
    file.name, file.package = _V1_FILE, _V1_PACKAGE
    file.ClearField("options")
    for message in file.message_type:
        for fld in message.field:
            if fld.type_name:  # set only on message/enum fields (presence matters here)
                fld.type_name = fld.type_name.replace(old, f".{_V1_PACKAGE}.")
    for method in file.service[0].method:
        method.input_type = method.input_type.replace(old, f".{_V1_PACKAGE}.")
        method.output_type = method.output_type.replace(old, f".{_V1_PACKAGE}.")
    pool.Add(file)


def enable_reflection(server: grpc.Server | grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Adds reflection (v1 and v1alpha) for `service_names` (full names; both reflection
    services are listed too) to a sync or asyncio server, over the default descriptor pool."""
    pool = descriptor_pool.Default()
    _add_v1_descriptor(pool)
    names = [*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME]
    servicer: reflection.ReflectionServicer | reflection.aio.ReflectionServicer
    if isinstance(server, grpc.aio.Server):
        servicer = reflection.aio.ReflectionServicer(names, pool=pool)
    else:
        servicer = reflection.ReflectionServicer(names, pool=pool)
    v1alpha_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {_METHOD: handler}),)
    )
