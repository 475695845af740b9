"""`SchedulerServer`: a `SchedulerApp` served from a background thread with its own event loop.

For processes that are not asyncio themselves (tests, `pdplane up`, benchmarks):

    server = SchedulerServer(SchedulerSettings(registry="127.0.0.1:50051", port=0))
    address = server.start()   # "127.0.0.1:<port>"
    ...
    server.stop()
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from pdplane.scheduler.app import SchedulerApp
from pdplane.scheduler.port import InstanceSource
from pdplane.scheduler.settings import SchedulerSettings

__all__ = ["SchedulerServer"]

_T = TypeVar("_T")
_START_TIMEOUT_S = 30.0  # bounds start(): binding plus the first registry snapshot wait


class SchedulerServer:
    """Runs one `SchedulerApp` on a private event loop thread.

    `start()` returns the gRPC address (raises what the app raised, e.g. RuntimeError when the
    port cannot be bound); `stop(grace)` stops the app and joins the thread.
    """

    def __init__(self, settings: SchedulerSettings, *, source: InstanceSource | None = None):
        self.app = SchedulerApp(settings, source=source)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """ "host:port" of the gRPC server (empty before start)."""
        return self.app.address

    def _call(self, coro: Coroutine[Any, Any, _T], timeout: float) -> _T:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> str:
        """Starts the loop thread and the app; returns "host:port"."""
        if self._thread is not None:
            raise RuntimeError("SchedulerServer already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="pdplane-scheduler", daemon=True
        )
        self._thread.start()
        try:
            return self._call(
                self.app.start(), _START_TIMEOUT_S + self.app.settings.registry_wait_s
            )
        except BaseException:
            self._shutdown_loop()
            raise

    def stop(self, grace: float = 0.5) -> None:
        """Stops serving (calls get `grace` seconds to finish) and joins the loop thread."""
        if self._loop is None:
            return
        try:
            self._call(self.app.stop(grace), grace + 10.0)
        finally:
            self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5.0)
        loop.close()
