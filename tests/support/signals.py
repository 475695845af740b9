"""Signals sent to one thread of another process (Linux `tgkill`): the kernel may hand a
process-directed signal to any of its threads, so a server must stop however it lands."""

from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path

# tgkill(2)'s syscall number per architecture (Linux's syscall tables).
_SYS_TGKILL = {"x86_64": 234, "aarch64": 131}


def other_threads(pid: int) -> list[int]:
    """The thread ids of `pid` other than its main thread (ascending)."""
    return sorted(int(t.name) for t in Path(f"/proc/{pid}/task").iterdir() if int(t.name) != pid)


def signal_thread(pid: int, tid: int, sig: signal.Signals) -> None:
    """Sends `sig` to thread `tid` of process `pid`; raises OSError when the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_TGKILL[os.uname().machine], pid, tid, int(sig)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
