"""The `tcp` KV transport: block bytes in gRPC messages (CPU instances, tests).

| module | responsibility |
| --- | --- |
| `transport.py` | `TcpTransport`: the `KvTransport` (pull client, push sessions, services) |
| `servicer.py` | `pdplane.v1.TcpKvTransfer` handlers: serve a pull, receive a push |
| `push.py` | prefill's push session (one client stream per pushed transfer) |
| `buffer.py` | decode's bounded receive buffer (`ReceiveBuffer`) |
"""

from __future__ import annotations

from pdplane.connector.transports.tcp.transport import DEFAULT_CHUNK_BYTES, TcpTransport

__all__ = ["DEFAULT_CHUNK_BYTES", "TcpTransport"]
