"""A supervised child process with its own log file, process group and bounded shutdown.

Used by `pdplane up`, the end-to-end tests and the vLLM launcher: a child never outlives its
parent's orderly shutdown (SIGTERM to the child, then to what is left of its process group, then
SIGKILL after a grace period), and a child that dies while we wait for it to become ready fails
the wait at once with the tail of its log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdplane.core import server_id as server_ids

__all__ = [
    "Cancelled",
    "ManagedProcess",
    "ProcessDied",
    "die_with_parent",
    "end_group",
    "grpc_serving",
    "http_ok",
    "http_server_id",
    "wait_until",
]


class ProcessDied(RuntimeError):
    """A supervised process exited while something waited on it."""


class Cancelled(RuntimeError):
    """A wait was cancelled (e.g. Ctrl-C during start-up)."""


#: Sets the parent-death signal (prctl PR_SET_PDEATHSIG = 1), then execs the command. A
#: parent already gone before the prctl (its pid is argv[1]) would never send it: exit then.
_DEATHSIG_EXEC = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def die_with_parent(argv: Sequence[str]) -> list[str]:
    """`argv` started so that Linux SIGTERMs it when the thread that started it dies: even a
    SIGKILLed supervisor leaves nothing behind. Elsewhere than on Linux, `argv` unchanged.

    The death signal is set by a short Python (`-S -I`: the standard library only) that then
    execs `argv` (same pid), not by a `preexec_fn`: that one makes subprocess fork and run
    Python in the child before exec, which can crash or deadlock when the parent has threads
    (gRPC's; Python's subprocess documentation says so)."""
    if sys.platform != "linux":
        return list(argv)
    return [sys.executable, "-S", "-I", "-c", _DEATHSIG_EXEC, str(os.getpid()), *argv]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def end_group(pgid: int, grace_s: float = 5.0) -> None:
    """Ends what is left of process group `pgid` once its leader has exited: SIGTERM, up to
    `grace_s` seconds for the members to exit (a vLLM engine core shuts down cleanly), then
    SIGKILL. Returns at once when the group is empty."""
    deadline = time.monotonic() + grace_s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not _group_alive(pgid):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)


class ManagedProcess:
    """One child process: `start()`, `alive()`, `stop()`; stdout+stderr go to `log_path`.

    The child runs in a new session (its own process group) so that `stop()` also reaches the
    grandchildren it spawns (vLLM's engine core, for instance). With `die_with_parent` (Linux)
    the child is also sent SIGTERM when the thread that started it dies, SIGKILL included: set
    it only when `start()` runs on a thread that lives as long as the child should (the main
    thread of a supervisor).

    Each `start()` hands the child a fresh server id (`$PDPLANE_SERVER_ID`, see
    `pdplane.core.server_id`), `server_id`, which a pdplane server reports in its health
    answers: pass it to `grpc_serving` / `http_ok` to know the answer comes from this child.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        die_with_parent: bool = False,
    ) -> None:
        self.name = name
        self.die_with_parent = die_with_parent
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.server_id = ""
        self._proc: subprocess.Popen[bytes] | None = None
        # Where this run's lines start in the log (bytes): logs are appended across runs and
        # restarts, and `tail` shows only the current run's.
        self._log_start = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc else None

    def start(self) -> None:
        """Starts the child. Raises RuntimeError if it is already running."""
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"{self.name} is already running (pid {self._proc.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.server_id = server_ids.new_server_id()
        env = {**(os.environ if self.env is None else self.env), server_ids.ENV: self.server_id}
        argv = die_with_parent(self.argv) if self.die_with_parent else self.argv
        with self.log_path.open("ab") as log:
            self._log_start = log.tell()
            self._proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self.cwd,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def check_alive(self) -> None:
        """Raises ProcessDied (with the log's tail) if the child has exited."""
        if self._proc is not None and self._proc.poll() is not None:
            raise ProcessDied(
                f"{self.name} exited with status {self._proc.returncode}; "
                f"last lines of {self.log_path}:\n{self.tail()}"
            )

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM to the child, SIGKILL to its process group after `grace_s` seconds; then
        `end_group` for what the child left behind. Returns the child's status.

        The first SIGTERM goes to the child alone: vLLM's API server shuts its engine down
        itself, and an engine signalled at the same time dies under it (an EngineDeadError
        traceback for a normal stop).
        """
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                proc.wait(timeout=5)
        # Grandchildren may linger after the leader exits; the group id outlives the leader.
        end_group(proc.pid)
        return proc.returncode

    def kill(self) -> None:
        """SIGKILL to the whole process group, at once: a crash, as fault-injection tests need."""
        if self._proc is not None:
            self._signal_group(signal.SIGKILL)
            self._proc.wait(timeout=10)

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self._proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    def tail(self, lines: int = 30, max_bytes: int = 1 << 20) -> str:
        """The last `lines` lines the current run wrote to the log, from at most its last
        `max_bytes` bytes (for error messages)."""
        try:
            with self.log_path.open("rb") as log:
                end = log.seek(0, os.SEEK_END)
                log.seek(max(self._log_start, end - max_bytes))
                text = log.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def wait_until(
    predicate: Callable[[], bool],
    timeout_s: float,
    *,
    interval_s: float = 0.25,
    watch: Sequence[ManagedProcess] = (),
    what: str = "condition",
    cancel: threading.Event | None = None,
) -> None:
    """Polls `predicate` until true. Raises ProcessDied if a watched process exits meanwhile,
    Cancelled as soon as `cancel` is set, and TimeoutError (naming `what`) after `timeout_s`
    seconds."""
    deadline = time.monotonic() + timeout_s
    pause = cancel if cancel is not None else threading.Event()
    while True:
        if pause.is_set():
            raise Cancelled(f"cancelled while waiting for {what}")
        for proc in watch:
            proc.check_alive()
        if predicate():
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        pause.wait(interval_s)


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when GET `url` answers 200."""
    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def http_server_id(url: str, timeout_s: float = 2.0) -> str | None:
    """The `server_id` in the JSON body GET `url` answers (any status; a pdplane gateway's
    `/health`), or None when nothing answers or the body has none."""
    try:
        body = httpx.get(url, timeout=timeout_s).json()
    except (httpx.HTTPError, ValueError):
        return None
    value = body.get("server_id") if isinstance(body, dict) else None
    return value if isinstance(value, str) else None


def grpc_serving(
    address: str, service: str = "", timeout_s: float = 2.0, server_id: str | None = None
) -> bool:
    """True when the gRPC health service at `address` reports `service` SERVING and, with
    `server_id`, the answering process reports that id (`pdplane.core.server_id`)."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply, call = stub.Check.with_call(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
        metadata = dict(call.initial_metadata() or ())
    if server_id is not None and metadata.get(server_ids.METADATA_KEY) != server_id:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
