"""Free loopback ports for processes that bind them later (vLLM instances, their KV servers).

vLLM binds its ports tens of seconds after a launcher chooses them; meanwhile other engines
take ephemeral ports for their own sockets, and a port chosen inside that range (bind to port
0) can be taken by one of them (seen: "Address already in use" on a KV port). Ports below the
kernel's ephemeral range are never handed out implicitly, so they are chosen from there.

A port is free when chosen but bound only later, so two choices made before either binds
could meet (seen: a registry port inside an instance's KV port run, on which its KV server
then failed with "Address already in use"): a port handed out is not handed out again by
this process while it is among the last `_REMEMBERED` ones.
"""

from __future__ import annotations

import random
import socket
import threading
from collections import deque
from pathlib import Path

__all__ = ["ephemeral_floor", "free_port_run"]

_LOWEST = 10_000
_REMEMBERED = 4096
_rng = random.Random()
_lock = threading.Lock()
_handed: deque[int] = deque(maxlen=_REMEMBERED)  # the ports handed out last, oldest first


def ephemeral_floor() -> int:
    """First port of the kernel's ephemeral range (Linux `ip_local_port_range`; else 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_run(count: int = 1, host: str = "127.0.0.1") -> int:
    """First of `count` consecutive ports, all free on `host` now, below the ephemeral range
    (a TP instance's KV servers bind kv_port + rank). Raises RuntimeError if none is found."""
    top = max(_LOWEST + count, ephemeral_floor()) - count
    with _lock:
        for _ in range(200):
            first = _rng.randrange(_LOWEST, top + 1)
            run = range(first, first + count)
            if any(port in _handed for port in run):
                continue
            socks: list[socket.socket] = []
            try:
                for port in run:
                    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    socks.append(sock)
                    sock.bind((host, port))
            except OSError:
                continue
            else:
                _handed.extend(run)
                return first
            finally:
                for sock in socks:
                    sock.close()
    raise RuntimeError(f"no {count} consecutive free ports below the ephemeral range")
