"""Starts `nccl_node.py` processes and talks to them (stdlib only; used by bench and tests).

Nodes sharing one GPU get their own `NCCL_HOSTID`, so they look like two hosts to NCCL (it then
uses its socket transport instead of refusing a "duplicate GPU"); nodes on separate GPUs keep
the real host id, so NCCL takes NVLink / PCIe P2P. NVLink multicast stays off
(`NCCL_NVLS_ENABLE=0`).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
NODE = Path(__file__).resolve().parent / "nccl_node.py"


class NodeError(RuntimeError):
    """A node died, answered nothing in time, or could not start."""


class NodeProcess:
    """One KV node process. `call(op, **args)` sends a command and returns its answer.

    `shared_gpu`: the node shares its GPU with its peer, so it gets its own `NCCL_HOSTID`;
    False on separate GPUs of one host, where NCCL should use NVLink / PCIe P2P instead.
    """

    def __init__(
        self,
        instance_id: str,
        log_dir: Path | None = None,
        *,
        shared_gpu: bool = True,
        **options: Any,
    ) -> None:
        self.instance_id = instance_id
        env = dict(os.environ)
        if shared_gpu:
            env["NCCL_HOSTID"] = f"pdplane-{instance_id}"
        env["NCCL_NVLS_ENABLE"] = "0"
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "services"), str(ROOT / "connector"), env.get("PYTHONPATH", "")]
        )
        argv = [sys.executable, str(NODE), "--instance-id", instance_id]
        for key, value in options.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        #: the node's log (None: its stderr goes nowhere)
        self._stderr = (
            open(log_dir / f"{instance_id}.log", "w")  # noqa: SIM115 - closed in stop()
            if log_dir
            else None
        )
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr or subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self._answers: queue.Queue[dict[str, Any]] = queue.Queue()
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            hello = self._answer(timeout=120.0)
            if "port" not in hello:
                raise NodeError(f"{instance_id} did not start: {hello}")
        except BaseException:
            self.stop()  # no process or log file left behind
            raise
        self.endpoint = f"127.0.0.1:{hello['port']}"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            (self.events if "event" in msg else self._answers).put(msg)
        self._answers.put({"ok": False, "error": "node exited", "exited": True})

    def _answer(self, timeout: float) -> dict[str, Any]:
        try:
            return self._answers.get(timeout=timeout)
        except queue.Empty:
            if self.proc.poll() is None:  # write every thread's stack to the node's log
                self.proc.send_signal(signal.SIGUSR1)
                time.sleep(1.0)
            raise NodeError(f"{self.instance_id}: no answer within {timeout} s") from None

    def send(self, op: str, **args: Any) -> None:
        """Sends a command without waiting (pair with `answer`)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float = 120.0) -> dict[str, Any]:
        """The next answer. Raises NodeError on a timeout."""
        return self._answer(timeout)

    def call(self, op: str, timeout: float = 120.0, **args: Any) -> dict[str, Any]:
        """Sends a command and returns its answer."""
        self.send(op, **args)
        return self._answer(timeout)

    def wait_event(self, name: str, timeout: float, **match: Any) -> dict[str, Any]:
        """Waits for an event line named `name` whose fields include `match` (earlier events
        are consumed). Raises NodeError on a timeout."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                break
            if ev.get("event") == name and all(ev.get(k) == v for k, v in match.items()):
                return ev
        raise NodeError(f"{self.instance_id}: no {name} event within {timeout} s")

    def dump_stacks(self, lines: int = 80) -> str:
        """Makes the node write every thread's Python stack to its log; returns the log's last
        `lines` lines (empty without a log)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
        if self._stderr is None:
            return ""
        self._stderr.flush()
        return "".join(Path(self._stderr.name).read_text().splitlines(True)[-lines:])

    def kill(self) -> None:
        """SIGKILL, as a crashed peer."""
        self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        """Asks the node to exit, kills it if it does not within 20 s; closes the log."""
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=30)
        if self._stderr is not None:
            self._stderr.close()
