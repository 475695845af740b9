"""Run one server in the foreground as its supervisor: `pdplane vllm` around vLLM's API server.

Why not exec the server: a terminal's Ctrl-C reaches its whole foreground process group, so
vLLM's engine core would get SIGINT at the same moment as its API server, die under it, and
the API server would print an EngineDeadError traceback for a normal stop. And a SIGKILLed API
server would leave its engine core behind with nobody to notice.

So the server runs in a process group of its own, with `die_with_parent` (it gets SIGTERM
when this supervisor is SIGKILLed); SIGINT, SIGTERM and SIGHUP reaching the supervisor are
forwarded to the server alone (SIGHUP as SIGTERM), which shuts its engine down itself; a
second one SIGKILLs the group. When the server exits, for any reason, what is left of its
group is ended (`end_group`) and its status becomes the supervisor's, except that a server
that exits with 0 without being asked to (vLLM's API server does when its engine core died)
gives 1, so that restart-on-failure policies (systemd, a supervisor) restart it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from types import FrameType

from pdplane.launch.process import die_with_parent, end_group

__all__ = ["run_in_foreground"]

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Longest wait before a stop signal taken by another thread is forwarded (s).
_WAKE_S = 0.2


def _exit_status(returncode: int) -> int:
    """A child's status as a shell reports it (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def _wait_running_handlers(proc: subprocess.Popen[bytes]) -> int:
    """`proc.wait()`, waking every `_WAKE_S` so that Python runs a signal handler even when
    the kernel gave the signal to another thread (gRPC's, a ready-line thread): a main thread
    blocked in waitpid() is interrupted only by a signal delivered to it, and Python runs
    handlers on the main thread alone."""
    while True:
        try:
            return proc.wait(timeout=_WAKE_S)
        except subprocess.TimeoutExpired:
            continue


def run_in_foreground(argv: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    """Starts `argv` (stdin/stdout/stderr inherited), forwards stop signals, waits for it and
    ends what it left behind. Returns its exit status (128 + N when killed by signal N; 1 for
    a 0 without a stop request).

    Must run on the main thread (it installs signal handlers; the previous ones are restored
    before it returns). Raises OSError when `argv` cannot be started.
    """
    proc = subprocess.Popen(
        die_with_parent(argv),
        env=dict(env) if env is not None else None,
        start_new_session=True,
    )
    signals_seen = 0

    def forward(signum: int, _frame: FrameType | None) -> None:
        nonlocal signals_seen
        signals_seen += 1
        with contextlib.suppress(ProcessLookupError):
            if signals_seen == 1:
                proc.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)
            else:  # asked twice: no more waiting for a graceful shutdown
                os.killpg(proc.pid, signal.SIGKILL)

    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    try:
        returncode = _wait_running_handlers(proc)
    finally:
        end_group(proc.pid)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if returncode == 0 and signals_seen == 0:
        sys.stderr.write(f"{argv[0]}: the server exited without being asked to stop\n")
        return 1
    return _exit_status(returncode)
