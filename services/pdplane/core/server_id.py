"""Which process answers a health check: an id every pdplane server reports.

A launcher that starts a server on a port must know that the process answering there is the one
it started, not an older one still holding the port (a second `pdplane up` on busy ports). Every
pdplane server reports `server_id()` in its health answers: gRPC health (`grpc.health.v1`) as the
initial metadata `pdplane-server-id`, the gateway's `GET /health` as the `server_id` field.
The id is `$PDPLANE_SERVER_ID` when set (launchers give each child a fresh `new_server_id()`),
else `<hostname>:<pid>`.
"""

from __future__ import annotations

import functools
import os
import secrets
import socket

__all__ = ["ENV", "METADATA_KEY", "new_server_id", "server_id"]

ENV = "PDPLANE_SERVER_ID"
METADATA_KEY = "pdplane-server-id"


@functools.cache
def server_id() -> str:
    """This process's id (read once): `$PDPLANE_SERVER_ID`, else `<hostname>:<pid>`."""
    return os.environ.get(ENV) or f"{socket.gethostname()}:{os.getpid()}"


def new_server_id() -> str:
    """A fresh random id (16 hex digits) for a launcher to hand to one child."""
    return secrets.token_hex(8)
