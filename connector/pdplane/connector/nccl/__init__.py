"""NCCL data path of the KV connector: a ctypes binding of libnccl, bounded 2-rank
communicators, block movement from/into paged KV caches, pull and push engines.

Imports nothing heavy: libnccl and torch.cuda are loaded on first use, so CPU-only machines can
import this package (and run the planning unit tests).
"""

from __future__ import annotations

from pdplane.connector.nccl.binding import NcclError, NcclLibrary, NcclUnavailableError
from pdplane.connector.nccl.communicator import (
    NcclAbortedError,
    NcclCommunicator,
    NcclTimeoutError,
)
from pdplane.connector.nccl.engine import NcclEngine, NcclTransferError, PullTiming
from pdplane.connector.nccl.plan import Strategy

__all__ = [
    "NcclAbortedError",
    "NcclCommunicator",
    "NcclEngine",
    "NcclError",
    "NcclLibrary",
    "NcclTimeoutError",
    "NcclTransferError",
    "NcclUnavailableError",
    "PullTiming",
    "Strategy",
]
