"""`pdplane grpc`: a small grpcurl for any gRPC server with reflection (every pdplane server).

    pdplane grpc 127.0.0.1:8051 list                                  # services, by reflection
    pdplane grpc 127.0.0.1:8051 list pdplane.v1.Registry              # its methods
    pdplane grpc 127.0.0.1:8051 pdplane.v1.Registry/ListInstances '{}'
    pdplane grpc 127.0.0.1:8051 grpc.health.v1.Health/Check '{"service": ""}'

The request is JSON (protobuf's JSON mapping, default `{}`), the answer is printed as JSON (one
object per message for a server stream). Types come from the server's reflection service, so
nothing but pdplane needs to be installed (grpcurl has no Debian package). Unary and
server-streaming methods. Exit codes: 0 success, 1 RPC error, 2 bad arguments.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from pydantic import Field
from pydantic_settings import CliPositionalArg

from pdplane.cli import fleet_credentials
from pdplane.core.grpc import util as grpc_util
from pdplane.core.settings import CommandSettings
from pdplane.core.token_file import token_file_field
from pdplane.v1 import registry_pb2, registry_pb2_grpc

__all__ = ["GrpcSettings", "main"]

_NO_BODY = "{}"


class GrpcSettings(CommandSettings):
    """`pdplane grpc ADDRESS list [SERVICE] | SERVICE/METHOD [BODY] [flags]`: a call by
    reflection."""

    address: CliPositionalArg[str] = Field(description="the server's gRPC address host:port")
    method: CliPositionalArg[str] = Field(
        description="`list` (its services; `list SERVICE`: that service's methods), or "
        "Service/Method (or grpcurl's Service.Method), e.g. pdplane.v1.Registry/ListInstances"
    )
    body: CliPositionalArg[str] = Field(
        _NO_BODY, description="the request as JSON; after `list`, a service"
    )
    token: str | None = Field(
        None,
        description="bearer token sent as call metadata (default: the local `pdplane up` "
        "fleet's shared token, if ADDRESS is its registry, scheduler or an instance's KvTransfer "
        "endpoint)",
    )
    token_file: str | None = token_file_field("--token")
    tls_ca: str | None = Field(None, description="CA certificate (PEM) to verify server TLS")
    timeout_s: float = Field(10.0, gt=0, description="deadline of the call (s)")


def _split(method: str) -> tuple[str, str]:
    """("pdplane.v1.Registry", "ListInstances") of "pdplane.v1.Registry/ListInstances" or of
    grpcurl's "pdplane.v1.Registry.ListInstances"."""
    service, _, name = method.rpartition("/" if "/" in method else ".")
    return service, name


def _list(channel: grpc.Channel, service: str | None) -> list[str]:
    """The server's services, sorted; with `service`, its methods as grpcurl lists them
    ("pdplane.v1.Registry.ListInstances"). Raises KeyError for a service it does not know."""
    db = ProtoReflectionDescriptorDatabase(channel)
    if service is None:
        return sorted(db.get_services())
    found = descriptor_pool.DescriptorPool(db).FindServiceByName(service)
    return [f"{found.full_name}.{method.name}" for method in found.methods]


def _call(channel: grpc.Channel, s: GrpcSettings) -> None:
    service, name = _split(s.method)
    pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
    descriptor = pool.FindServiceByName(service).FindMethodByName(name)
    request_cls = message_factory.GetMessageClass(descriptor.input_type)
    response_cls: Any = message_factory.GetMessageClass(descriptor.output_type)
    request = json_format.Parse(s.body, request_cls())
    path = f"/{service}/{name}"
    kwargs: dict[str, Any] = {
        "request_serializer": request_cls.SerializeToString,
        "response_deserializer": response_cls.FromString,
    }
    metadata = grpc_util.token_metadata(s.token)
    if descriptor.client_streaming:
        raise SystemExit("error: client-streaming methods are not supported")
    if descriptor.server_streaming:
        stream = channel.unary_stream(path, **kwargs)
        replies = stream(request, timeout=s.timeout_s, metadata=metadata)
    else:
        replies = [
            channel.unary_unary(path, **kwargs)(request, timeout=s.timeout_s, metadata=metadata)
        ]
    for reply in replies:
        print(json.dumps(json_format.MessageToDict(reply), indent=2), flush=True)


#: Deadline of the registry lookup of a joined instance's KvTransfer endpoint (s).
_LOOKUP_TIMEOUT_S = 2.0


def _joined_instance_token(address: str) -> str | None:
    """The local fleet's shared token when `address` is the KvTransfer endpoint of an instance
    registered with the fleet's registry but absent from its credentials file (one that joined
    later, e.g. `pdplane vllm`); None otherwise, also when the registry does not answer."""
    creds = fleet_credentials.local()
    if creds is None:
        return None
    request = registry_pb2.ListInstancesRequest()
    metadata = grpc_util.token_metadata(creds.token)
    try:
        with grpc_util.channel(creds.registry) as channel:
            stub = registry_pb2_grpc.RegistryStub(channel)
            reply = stub.ListInstances(request, timeout=_LOOKUP_TIMEOUT_S, metadata=metadata)
    except grpc.RpcError:
        return None
    endpoints = {i.spec.kv_endpoint for i in reply.instances}
    return creds.token if address in endpoints else None


def main(argv: list[str]) -> int:
    """Runs `pdplane grpc ADDRESS list|SERVICE/METHOD [BODY] [flags]`."""
    s = GrpcSettings.parse(argv, prog="pdplane grpc")
    if s.method != "list" and not all(_split(s.method)):
        sys.stderr.write(
            f"error: pdplane grpc: expected `list` or Service/Method, got {s.method!r}\n"
        )
        return 2
    # Nothing to type for the local `pdplane up` fleet's services: its token is in its file.
    s.token = fleet_credentials.token_for(s.address, s.token) or _joined_instance_token(s.address)
    with grpc_util.channel(s.address, s.tls_ca) as channel:
        try:
            if s.method == "list":
                print("\n".join(_list(channel, None if s.body == _NO_BODY else s.body)))
            else:
                _call(channel, s)
        except grpc.RpcError as exc:
            code = exc.code().name if isinstance(exc, grpc.Call) else "UNKNOWN"
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            sys.stderr.write(f"pdplane grpc: {s.address}: {code}: {details}\n")
            return 1
        except (KeyError, json_format.ParseError) as exc:
            sys.stderr.write(f"pdplane grpc: {exc}\n")
            return 2
    return 0
