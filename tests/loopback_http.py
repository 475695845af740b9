"""A plain `http.server` handler served on a loopback port in a thread, for tests that need a
stand-in HTTP endpoint (not a real pdplane service)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["serving"]


@contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serves `handler` on 127.0.0.1 (a free port) until the block ends; yields the base URL
    `http://127.0.0.1:PORT`. Shuts the server down and joins its thread (5 s bound) on exit."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
