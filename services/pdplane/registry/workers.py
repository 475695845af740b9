"""The primary's side of `pdplane registry --workers N`: starts, watches and stops the N - 1
worker processes (`pdplane.registry.worker`) that serve its port beside it."""

from __future__ import annotations

import logging
import select
import subprocess
import sys
import threading
import time

from pdplane.registry.settings import RegistrySettings
from pdplane.registry.worker import WorkerConfig

__all__ = ["WorkerPool"]

log = logging.getLogger(__name__)

#: How long a worker may take to bind the port and say `ready` (s).
READY_TIMEOUT_S = 30.0
#: How often the pool looks for a worker that exited (s); one that did is started again.
_WATCH_S = 0.5


class WorkerPool:
    """`count` worker processes serving `port` beside this process, linked to it at `link`.

    `start()` returns once every worker printed `ready` (raises RuntimeError naming the worker's
    exit status when one could not start, or its silence after `READY_TIMEOUT_S`). A worker that
    exits while serving is logged and started again. `stop(grace)` closes each worker's stdin
    (the worker stops serving, giving open calls 0.5 s) and kills the ones still running after
    `grace` + 5 s. A primary that dies leaves no worker behind: its workers see their
    stdin close.
    """

    def __init__(self, settings: RegistrySettings, port: int, link: str, count: int) -> None:
        self._config = WorkerConfig(
            settings=settings.model_dump(mode="json"), port=port, link=link
        ).model_dump_json()
        self._workers: list[subprocess.Popen[bytes]] = []
        self._count = count
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._watcher = threading.Thread(
            target=self._watch, name="pdplane-registry-workers", daemon=True
        )

    @property
    def pids(self) -> list[int]:
        """The workers' process ids."""
        with self._lock:
            return [worker.pid for worker in self._workers]

    def start(self) -> None:
        """Starts the workers; returns when all serve."""
        try:
            for _ in range(self._count):
                worker = self._spawn()
                with self._lock:
                    self._workers.append(worker)
        except BaseException:
            self.stop(0.0)
            raise
        self._watcher.start()

    def _spawn(self) -> subprocess.Popen[bytes]:
        worker = subprocess.Popen(
            [sys.executable, "-m", "pdplane.registry.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert worker.stdin is not None and worker.stdout is not None
        worker.stdin.write(self._config.encode() + b"\n")
        worker.stdin.flush()
        ready, _, _ = select.select([worker.stdout], [], [], READY_TIMEOUT_S)
        line = worker.stdout.readline() if ready else b""
        worker.stdout.close()
        if line.strip() != b"ready":
            worker.kill()
            status = worker.wait()
            raise RuntimeError(
                f"registry worker did not start (exit status {status}; its log is above)"
                if ready
                else f"registry worker did not bind within {READY_TIMEOUT_S:.0f} s"
            )
        return worker

    def _watch(self) -> None:
        while not self._stopping.wait(_WATCH_S):
            with self._lock:
                exited = [(i, w) for i, w in enumerate(self._workers) if w.poll() is not None]
            for i, worker in exited:
                log.warning("registry worker %d exited with %s; starting it again", worker.pid,
                            worker.returncode)
                try:
                    replacement = self._spawn()
                except (OSError, RuntimeError) as exc:
                    log.error("%s; retrying in 1 s", exc)
                    time.sleep(1.0)
                    continue
                with self._lock:
                    if self._stopping.is_set():
                        replacement.kill()
                        replacement.wait()
                        return
                    self._workers[i] = replacement

    def stop(self, grace: float) -> None:
        """Stops every worker (see the class docstring); idempotent."""
        self._stopping.set()
        if self._watcher.is_alive():
            self._watcher.join(timeout=READY_TIMEOUT_S + 5.0)
        with self._lock:
            workers, self._workers = self._workers, []
        for worker in workers:
            if worker.stdin is not None:
                worker.stdin.close()
        deadline = time.monotonic() + grace + 5.0
        for worker in workers:
            try:
                worker.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
