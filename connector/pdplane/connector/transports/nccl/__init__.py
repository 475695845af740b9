"""The `nccl` KV transport: block bytes GPU to GPU over NCCL point-to-point, control over gRPC.

| module | responsibility |
| --- | --- |
| `transport.py` | `NcclTransport`: the `KvTransport` (pull, push, pre-connect, peers gone) |
| `servicer.py` | `pdplane.v1.NcclKvTransfer` handlers (`Pair`, `Preconnect`) |
| `engine.py` | `NcclEngine`: pairs (handshake, cap, close, peers gone), the caller's pull |
| `serving.py` | the server's end of a pair: join, warm its thread, serve pulls and push begins |
| `pairs.py` | the pair table: one communicator per (peer, rank, purpose), cap, LRU eviction |
| `control.py` | the two ends of a pair's control stream |
| `push.py` | push mode: bounded GPU receive buffer (`ReceiveBuffer`), pinned-host spill, sessions |
| `communicator.py` | one rank of a 2-rank communicator: non-blocking init, bounded waits, abort |
| `errors.py` | `NcclTransferError` |
| `blocks.py` | physical byte view of any backend's KV tensor; gather, send, receive, scatter |
| `chunk_plan.py` | how requested blocks become messages (pure Python) |
| `binding.py` | ctypes binding of the few libnccl calls used |

Imports nothing heavy: libnccl and torch.cuda are loaded on first use, so CPU-only machines can
import this package (and run the planning unit tests).
"""

from __future__ import annotations

from pdplane.connector.transports.nccl.binding import NcclError, NcclLibrary, NcclUnavailableError
from pdplane.connector.transports.nccl.communicator import (
    NcclAbortedError,
    NcclCommunicator,
    NcclTimeoutError,
)
from pdplane.connector.transports.nccl.engine import NcclEngine, PullTiming
from pdplane.connector.transports.nccl.errors import NcclTransferError
from pdplane.connector.transports.nccl.transport import NcclTransport

__all__ = [
    "NcclAbortedError",
    "NcclCommunicator",
    "NcclEngine",
    "NcclError",
    "NcclLibrary",
    "NcclTimeoutError",
    "NcclTransferError",
    "NcclTransport",
    "NcclUnavailableError",
    "PullTiming",
]
