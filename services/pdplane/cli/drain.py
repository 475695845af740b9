"""`pdplane drain ID`: stop scheduling new requests onto an instance before taking it away.

    pdplane drain decode-2 [--registry HOST:PORT[,HOST:PORT...]] [--admin-token T] [--tls-ca CA]

(The id may also come after the flags, or from PDPLANE_INSTANCE_ID.)

Draining another process's instance is an operator's act: it needs the registry's admin token
(`--admin-token` / `PDPLANE_ADMIN_TOKEN`; for the fleet of a local `pdplane up`, read from its
credentials file by default, see `pdplane.cli.fleet_credentials`) unless the registry runs
without any token. Marks the instance DRAINING in the registry (still listed, never scheduled
again; requests already on it finish), so that stopping it afterwards loses no request.
(There is no "remove": a live instance whose lease vanished registers itself again within a
second; stop the process and its lease ends.) Exit codes: 0 done, 1 unknown instance,
refused or registry error, 2 bad flags.
"""

from __future__ import annotations

import sys

import grpc
from pydantic import Field
from pydantic_settings import CliPositionalArg

from pdplane.cli import fleet_credentials
from pdplane.core import defaults
from pdplane.core.grpc import util as grpc_util
from pdplane.core.settings import CommandSettings
from pdplane.core.token_file import token_file_field
from pdplane.registry.failover import RegistryEndpoints, call_any
from pdplane.v1 import instance_pb2, registry_pb2

__all__ = ["DrainSettings", "drain_instance", "main"]


class DrainSettings(CommandSettings):
    """`pdplane drain INSTANCE-ID [flags]` (each also a `PDPLANE_*` environment variable)."""

    instance_id: CliPositionalArg[str] = Field(
        "", description="registry id of the instance (see `pdplane ls`; or PDPLANE_INSTANCE_ID)"
    )
    registry: str = Field(
        f"127.0.0.1:{defaults.REGISTRY_PORT}",
        description="registry gRPC address host:port, or several replicas' comma-separated",
    )
    admin_token: str | None = Field(
        None,
        description="registry admin token (default: the local `pdplane up` fleet's, if this is "
        "its registry)",
    )
    admin_token_file: str | None = token_file_field("--admin-token")
    tls_ca: str | None = Field(None, description="CA certificate (PEM) to verify registry TLS")
    timeout_s: float = Field(5.0, gt=0, description="deadline of each call (s)")


def drain_instance(
    endpoints: RegistryEndpoints,
    instance_id: str,
    metadata: tuple[tuple[str, str], ...],
    timeout_s: float = 5.0,
) -> str:
    """Marks `instance_id` DRAINING (Deregister with drain, the admin credential in
    `metadata`); returns its state name after the call ("draining"). Raises grpc.RpcError
    (NOT_FOUND for an unknown id, PERMISSION_DENIED without the admin token)."""
    # No lease id: the admin credential, not a lease, authorizes an operator's drain.
    request = registry_pb2.DeregisterRequest(instance_id=instance_id, drain=True)
    reply = call_any(
        endpoints, lambda stub: stub.Deregister(request, timeout=timeout_s, metadata=metadata)
    )
    return instance_pb2.InstanceState.Name(reply.state).removeprefix("INSTANCE_STATE_").lower()


def main(argv: list[str]) -> int:
    """Runs `pdplane drain`; see the module docstring for exit codes."""
    s = DrainSettings.parse(argv, prog="pdplane drain")
    if not s.instance_id:
        sys.stderr.write("error: pdplane drain: give the instance id (see `pdplane drain -h`)\n")
        return 2
    admin_token = fleet_credentials.token_for(s.registry, s.admin_token, admin=True)
    metadata = grpc_util.token_metadata(admin_token)
    endpoints = RegistryEndpoints(s.registry, s.tls_ca)
    try:
        state = drain_instance(endpoints, s.instance_id, metadata, s.timeout_s)
    except grpc.RpcError as exc:
        hint = ""
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED and not s.admin_token:
            flags = "--admin-token or --admin-token-file"
            hint = f" ({fleet_credentials.unauthenticated_hint(s.registry, flags)})"
        sys.stderr.write(f"pdplane drain: {exc.code().name}: {exc.details()}{hint}\n")
        return 1
    finally:
        endpoints.close()
    sys.stdout.write(f"{s.instance_id}: {state}\n")
    return 0
