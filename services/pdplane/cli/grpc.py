"""`pdplane grpc`: a small grpcurl for any gRPC server with reflection (every pdplane server).

    pdplane grpc 127.0.0.1:50051 list                                  # services, by reflection
    pdplane grpc 127.0.0.1:50051 pdplane.v1.Registry/ListInstances '{}'
    pdplane grpc 127.0.0.1:50051 grpc.health.v1.Health/Check '{"service": ""}'

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

from pdplane.core import grpc_util
from pdplane.core.settings import CommandSettings
from pdplane.core.token_file import token_file_field

__all__ = ["GrpcSettings", "main"]


class GrpcSettings(CommandSettings):
    """Flags of `pdplane grpc` besides its positional arguments."""

    token: str | None = Field(None, description="bearer token sent as call metadata")
    token_file: str | None = token_file_field("--token")
    tls_ca: str | None = Field(None, description="CA certificate (PEM) to verify server TLS")
    timeout_s: float = Field(10.0, gt=0, description="deadline of the call (s)")


def _call(channel: grpc.Channel, method: str, body: str, s: GrpcSettings) -> None:
    service, _, name = method.rpartition("/")
    pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
    descriptor = pool.FindServiceByName(service).FindMethodByName(name)
    request_cls = message_factory.GetMessageClass(descriptor.input_type)
    response_cls: Any = message_factory.GetMessageClass(descriptor.output_type)
    request = json_format.Parse(body, request_cls())
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


def main(argv: list[str]) -> int:
    """Runs `pdplane grpc ADDRESS list|SERVICE/METHOD [JSON] [flags]`."""
    positional = [a for a in argv if not a.startswith("--")]
    flags = [a for a in argv if a.startswith("--")]
    # Flag values follow their flag: take them back out of the positional list.
    for i, arg in enumerate(argv[:-1]):
        if arg.startswith("--") and "=" not in arg and argv[i + 1] in positional:
            positional.remove(argv[i + 1])
            flags.append(argv[i + 1])
    settings = GrpcSettings.parse(flags, prog="pdplane grpc")
    if len(positional) < 2 or (positional[1] != "list" and "/" not in positional[1]):
        sys.stderr.write(__doc__.split("\n\n")[1] + "\n")
        return 2
    address, what = positional[0], positional[1]
    body = positional[2] if len(positional) > 2 else "{}"
    with grpc_util.channel(address, settings.tls_ca) as channel:
        try:
            if what == "list":
                db = ProtoReflectionDescriptorDatabase(channel)
                print("\n".join(sorted(db.get_services())))
            else:
                _call(channel, what, body, settings)
        except grpc.RpcError as exc:
            code = exc.code().name if isinstance(exc, grpc.Call) else "UNKNOWN"
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            sys.stderr.write(f"pdplane grpc: {address}: {code}: {details}\n")
            return 1
        except (KeyError, json_format.ParseError) as exc:
            sys.stderr.write(f"pdplane grpc: {exc}\n")
            return 2
    return 0
