"""KV transports by name: `tcp` (gRPC byte stream; CPU instances, tests) and `nccl` (GPUs).

A transport is one folder here (`tcp/`, `nccl/`) implementing `base.KvTransport`: its byte
mover, its gRPC service and handlers, its push receive buffer (`receive_buffer.ReceiveBuffer`).
Adding one is that folder, its proto file and one line in `_FACTORIES`. Modules are imported
only when chosen, so a CPU instance never imports NCCL code.
"""

from __future__ import annotations

import importlib
from typing import Any

from pdplane.connector.transports.base import (
    KvTransport,
    Peer,
    PeerInstance,
    PullRequest,
    PullResult,
    TransferError,
)

__all__ = [
    "KvTransport",
    "Peer",
    "PeerInstance",
    "PullRequest",
    "PullResult",
    "TransferError",
    "create_transport",
]

#: transport name -> "module:class"
_FACTORIES: dict[str, str] = {
    "tcp": "pdplane.connector.transports.tcp.transport:TcpTransport",
    "nccl": "pdplane.connector.transports.nccl.transport:NcclTransport",
}


def create_transport(name: str, **options: Any) -> KvTransport:
    """Builds the transport called `name`; raises ValueError for an unknown name."""
    try:
        target = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown KV transport {name!r}; known: {sorted(_FACTORIES)}") from None
    module_name, _, cls_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    transport: KvTransport = cls(**options)
    return transport
