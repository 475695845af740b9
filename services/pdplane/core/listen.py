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

import errno
import socket
import sys
from collections.abc import Iterable

__all__ = ["bind_error", "port_taken", "refuse_taken", "taken_message"]


def bind_error(host: str, port: int) -> OSError | None:
    """Why `host`:`port` (TCP) cannot be bound now (errno EADDRINUSE: another process listens
    there; EADDRNOTAVAIL: `host` is not this machine's; EACCES: a privileged port), or None."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc
    return None


def port_taken(host: str, port: int) -> bool:
    """True when `host`:`port` (TCP) cannot be bound now (in use, or not this machine's)."""
    return bind_error(host, port) is not None


def taken_message(prog: str, host: str, wanted: Iterable[tuple[int, str]]) -> str | None:
    """One line naming every port of `wanted` ((port, flag) pairs; port 0, "any free port", is
    never checked) that cannot be bound on `host`, and why; None when all can."""
    failed = [
        (port, flag, err) for port, flag in wanted if port and (err := bind_error(host, port))
    ]
    if not failed:
        return None
    shown = f"[{host}]" if ":" in host else host
    flags = ", ".join(dict.fromkeys(flag for _, flag, _ in failed))
    if all(err.errno == errno.EADDRINUSE for _, _, err in failed):
        listed = ", ".join(f"{shown}:{port} ({flag})" for port, flag, _ in failed)
        return (
            f"{prog}: address already in use: {listed}; stop the process listening there or "
            f"choose another port ({flags})"
        )
    listed = ", ".join(
        f"{shown}:{port} ({flag}): {err.strerror or err}" for port, flag, err in failed
    )
    return f"{prog}: cannot listen on {listed}; check --host and {flags}"


def refuse_taken(prog: str, host: str, wanted: Iterable[tuple[int, str]]) -> bool:
    """Writes `taken_message` to stderr and returns True when a port of `wanted` is taken (the
    caller then exits 2); returns False, writing nothing, when all are free."""
    message = taken_message(prog, host, wanted)
    if message is None:
        return False
    sys.stderr.write(message + "\n")
    return True
