"""The engine process ends with its parent: no orphaned engine keeps the KV port and its memory.

vLLM runs the engine core, where this connector lives, as a multiprocessing child of its API
server. When the API server dies without shutting it down (SIGKILL, the OOM killer), the
engine core is re-parented to init and lives on: ~850 MB, its KvTransfer port bound, still
heartbeating, so a relaunch on the same ports fails and the gateway keeps routing to an HTTP
server that no longer exists.

`watch_parent(before_exit)` starts a daemon thread that blocks on multiprocessing's parent
sentinel (a pipe whose other end only the parent holds, readable once the parent is gone: no
polling). Then it runs `before_exit` (the connector deregisters, so the gateway knows at once
rather than after the lease TTL), sends this process SIGTERM (vLLM's own engine shutdown) and,
if the process still lives `grace_s` seconds later, ends it with `os._exit`.

An engine that runs inside the API server's own process (no multiprocessing parent) has
nothing to watch; the call is then a no-op. Once per process; later calls are ignored.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable

__all__ = ["watch_parent"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_watching = False
_before_exit: list[Callable[[], None]] = []


def watch_parent(before_exit: Callable[[], None] | None = None, grace_s: float = 10.0) -> bool:
    """Ends this process when its multiprocessing parent dies (see the module docstring).

    Args:
        before_exit: called on the watcher thread once the parent is gone, after the ones of
            earlier calls (exceptions are logged, never raised); keep it bounded (e.g. a
            deregistration with a deadline).
        grace_s: seconds between the SIGTERM and the hard exit (the first call's value).

    Returns:
        True when a watcher runs (started now or by an earlier call), False when this process
        has no multiprocessing parent.
    """
    global _watching
    parent = multiprocessing.parent_process()
    if parent is None:
        return False
    with _lock:
        if before_exit is not None:
            _before_exit.append(before_exit)
        if _watching:
            return True
        _watching = True
    threading.Thread(
        target=_watch, args=(parent, grace_s), name="pdplane-lifeline", daemon=True
    ).start()
    return True


def _watch(parent: multiprocessing.process.BaseProcess, grace_s: float) -> None:
    parent.join()  # returns once the parent's end of the sentinel pipe is closed: it exited
    log.warning("parent process %s is gone; this engine process exits too", parent.pid)
    with _lock:
        callbacks = list(_before_exit)
    for callback in callbacks:
        try:
            callback()
        except Exception:
            log.exception("clean-up before exit failed")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)  # a daemon thread: a process that shuts down in time never gets here
    os._exit(1)
