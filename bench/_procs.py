"""Child processes of the benchmarks (relay, flow control, routing, sim scale): pinned with
taskset, logged, CPU-accounted, stopped."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Any

__all__ = ["Proc", "spawn"]

_TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _cpu_ms(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * _TICK_MS  # utime + stime


class Proc:
    """A started child process (and its descendants, for CPU accounting)."""

    def __init__(self, name: str, popen: subprocess.Popen[str], log: IO[str]) -> None:
        self.name = name
        self.popen = popen
        self._log = log

    def cpu_ms(self) -> float:
        """User + system CPU time (ms) of the process tree so far."""
        tree = _children()
        total, stack = 0.0, [self.popen.pid]
        while stack:
            pid = stack.pop()
            total += _cpu_ms(pid)
            stack.extend(tree.get(pid, []))
        return total

    def read_json_lines(self, count: int, timeout_s: float = 120.0) -> list[dict[str, Any]]:
        """Reads `count` JSON lines from the child's stdout (e.g. `pdplane sim` readiness).

        Raises RuntimeError when the child exits first or `timeout_s` passes (start-up on a
        loaded machine can take tens of seconds).
        """
        stdout = self.popen.stdout
        assert stdout is not None
        found: queue.Queue[str] = queue.Queue()

        def pump() -> None:  # a blocking readline in a thread keeps the wait bounded
            for line in stdout:
                if line.strip().startswith("{"):
                    found.put(line)
            found.put("")

        threading.Thread(target=pump, name=f"{self.name}-stdout", daemon=True).start()
        deadline = time.monotonic() + timeout_s
        lines: list[dict[str, Any]] = []
        while len(lines) < count:
            try:
                line = found.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                line = ""
            if not line:
                code = self.popen.poll()
                why = f"exited with {code}" if code is not None else f"silent for {timeout_s} s"
                raise RuntimeError(f"{self.name} {why}; see {self._log.name}")
            lines.append(json.loads(line))
        return lines

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        if self.popen.stdout is not None and not self.popen.stdout.closed:
            # The reader thread may hold it; the process is gone either way.
            with contextlib.suppress(OSError, ValueError):
                self.popen.stdout.close()
        self._log.close()


def spawn(
    name: str,
    argv: list[str],
    cpus: str,
    log_dir: Path,
    *,
    stdout_pipe: bool = False,
    env: dict[str, str] | None = None,
) -> Proc:
    """Starts `argv` pinned to `cpus` (taskset list, e.g. "0") with stderr in `log_dir/name.log`."""
    log = (log_dir / f"{name}.log").open("w")
    prefix = ["taskset", "-c", cpus] if cpus and shutil.which("taskset") else []
    popen = subprocess.Popen(
        [*prefix, *argv],
        stdout=subprocess.PIPE if stdout_pipe else log,
        stderr=log,
        text=True,
        env={**os.environ, **(env or {})},
    )
    return Proc(name, popen, log)
