"""Whether the TCP ports a command will listen on are free, checked before it starts anything.

A long-running command (`pdplane sim`, `registry`, `scheduler`, `gateway`) on a port another
process listens on would otherwise fail deep inside gRPC, aiohttp or uvicorn (a traceback, or a
gRPC "Failed to bind" with no reason); `refuse_taken` prints one line naming the address and
the flag to change, and the command exits 2 (bad input, as for a bad flag). The check is a
plain bind with SO_REUSEADDR, as the servers bind: a port in TIME_WAIT is free, a listening one
is not. A port taken between the check and the server's own bind still fails that bind (exit
status 1).
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterable

__all__ = ["port_taken", "refuse_taken", "taken_message"]


def port_taken(host: str, port: int) -> bool:
    """True when `host`:`port` (TCP) cannot be bound now (in use, or not this machine's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def taken_message(prog: str, host: str, wanted: Iterable[tuple[int, str]]) -> str | None:
    """One line naming every taken port of `wanted` ((port, flag) pairs; port 0, "any free
    port", is never taken) on `host`, or None when all are free."""
    taken = [(port, flag) for port, flag in wanted if port and port_taken(host, port)]
    if not taken:
        return None
    shown = f"[{host}]" if ":" in host else host
    listed = ", ".join(f"{shown}:{port} ({flag})" for port, flag in taken)
    flags = ", ".join(dict.fromkeys(flag.split(" ")[0] for _, flag in taken))
    return (
        f"{prog}: address already in use: {listed}; stop the process listening there or "
        f"choose another port ({flags})"
    )


def refuse_taken(prog: str, host: str, wanted: Iterable[tuple[int, str]]) -> bool:
    """Writes `taken_message` to stderr and returns True when a port of `wanted` is taken (the
    caller then exits 2); returns False, writing nothing, when all are free."""
    message = taken_message(prog, host, wanted)
    if message is None:
        return False
    sys.stderr.write(message + "\n")
    return True
