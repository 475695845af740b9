"""The worker processes of `pdplane registry --workers N` (docs/registry.md, "Worker
processes"): started, awaited until they serve, stopped.

One registry process answers its heartbeats on one thread: gRPC Python's read and write per
heartbeat (~100 us of a core) make one process saturate one core near 7,000 heartbeats/s
whatever the machine has. Workers spread that per-message cost over processes (and cores): each
serves the public port (SO_REUSEPORT; the kernel spreads connections over them) and hands its
heartbeats to the store process in batches (`pdplane.registry.worker`).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time

from pdplane.core import server_id as server_ids
from pdplane.registry.settings import RegistrySettings

__all__ = ["WorkerProcesses"]

#: Longest wait for a worker to serve (s).
START_TIMEOUT_S = 30.0


class WorkerProcesses:
    """`count` worker processes serving `settings.host:settings.port` over the store process
    at `store` ("unix:PATH")."""

    def __init__(self, settings: RegistrySettings, store: str, count: int) -> None:
        self._settings = settings
        self._store = store
        self._count = count
        self._procs: list[subprocess.Popen[str]] = []
        self.port = settings.port

    def start(self) -> int:
        """Starts the workers one by one (the first binds port 0 for the others when
        `settings.port` is 0); returns the port they serve. Raises RuntimeError, with every
        worker stopped, when one exits or does not serve within `START_TIMEOUT_S`."""
        try:
            for _ in range(self._count):
                self.port = self._start_one(self.port)
        except BaseException:
            self.stop()
            raise
        return self.port

    def _start_one(self, port: int) -> int:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdplane.registry.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            # The workers answer health checks as this registry (launchers match the id).
            env={**os.environ, server_ids.ENV: server_ids.server_id()},
        )
        self._procs.append(proc)
        assert proc.stdin is not None and proc.stdout is not None
        config = {
            "settings": self._settings.model_dump(mode="json"),
            "store": self._store,
            "port": port,
        }
        proc.stdin.write(json.dumps(config) + "\n")
        proc.stdin.close()
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("ready "):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)  # its exit status, when it failed (its error on stderr)
            raise RuntimeError(
                f"registry worker did not serve within {START_TIMEOUT_S:.0f} s "
                f"(exit status {proc.poll()})"
            )
        return int(line.split()[1])

    def alive(self) -> int:
        """How many workers are running."""
        return sum(proc.poll() is None for proc in self._procs)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM to every worker, SIGKILL to those still running after `grace_s`."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self._procs = []
