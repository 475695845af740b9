"""pdplane.launch.process: supervised children never outlive their supervisor."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from pdplane.launch.process import Cancelled, ManagedProcess, ProcessDied, wait_until


def test_child_dies_with_a_sigkilled_supervisor(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    supervisor = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from pdplane.launch.process import ManagedProcess
        p = ManagedProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"],
                           Path({str(tmp_path / "child.log")!r}), die_with_parent=True)
        p.start()
        Path({str(pid_file)!r}).write_text(str(p.pid))
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", supervisor])
    try:
        wait_until(lambda: pid_file.exists() and pid_file.read_text() != "", 30.0, what="child")
        child = psutil.Process(int(pid_file.read_text()))
        assert child.is_running()
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        child.wait(timeout=10)  # raises TimeoutExpired if the child outlived its supervisor
    finally:
        if parent.poll() is None:
            parent.kill()


def test_die_with_parent_runs_no_python_between_fork_and_exec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A `preexec_fn` makes subprocess fork without exec'ing at once, and runs Python in the
    # child, which can crash or deadlock when the parent has threads (gRPC's): a vLLM child
    # died with "Segmentation fault" in threading._after_fork. The death signal must be set
    # without it, and still be set in the child.
    seen: list[dict[str, object]] = []
    real = subprocess.Popen

    def recording(*args: object, **kwargs: object) -> object:
        seen.append(kwargs)
        return real(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(subprocess, "Popen", recording)
    out = tmp_path / "pdeathsig"
    probe = (
        "import ctypes, sys; v = ctypes.c_int(); "
        "ctypes.CDLL(None).prctl(2, ctypes.byref(v)); open(sys.argv[1], 'w').write(str(v.value))"
    )
    proc = ManagedProcess(
        "probe", [sys.executable, "-c", probe, str(out)], tmp_path / "p.log", die_with_parent=True
    )
    proc.start()
    wait_until(lambda: out.exists() and out.read_text() != "", 30.0, what="probe")
    assert out.read_text() == str(int(signal.SIGTERM))  # PR_GET_PDEATHSIG in the child
    assert [k.get("preexec_fn") for k in seen] == [None]
    proc.stop(grace_s=5)


def test_stop_ends_the_whole_process_group(tmp_path: Path) -> None:
    script = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    )
    proc = ManagedProcess("tree", [sys.executable, "-c", script], tmp_path / "tree.log")
    proc.start()
    assert proc.pid is not None
    wait_until(lambda: len(psutil.Process(proc.pid).children()) == 1, 30.0, what="grandchild")
    grandchild = psutil.Process(proc.pid).children()[0]
    proc.stop(grace_s=5)
    grandchild.wait(timeout=10)
    assert not proc.alive()


def test_wait_fails_fast_when_the_watched_process_dies(tmp_path: Path) -> None:
    proc = ManagedProcess(
        "crasher", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"], tmp_path / "c.log"
    )
    proc.start()
    with pytest.raises(ProcessDied, match="status 3") as info:
        wait_until(lambda: False, 30.0, watch=[proc], what="never")
    assert "boom" in str(info.value)


def test_wait_is_cancelled_at_once() -> None:
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    started = time.monotonic()
    with pytest.raises(Cancelled):
        wait_until(lambda: False, 60.0, cancel=cancel, what="never")
    assert time.monotonic() - started < 5.0  # not its 60 s timeout


def test_a_died_message_shows_this_run_s_lines_not_an_earlier_run_s(tmp_path: Path) -> None:
    # --log-dir files are appended across runs: the tail of a process that died names only
    # what it printed itself.
    log = tmp_path / "svc.log"
    log.write_text("an earlier run's last words\n")
    script = "import sys; print('this run', flush=True); sys.exit(3)"
    proc = ManagedProcess("svc", [sys.executable, "-c", script], log)
    for _ in range(2):  # a restart on the same log shows its own lines only, too
        proc.start()
        deadline = time.monotonic() + 10
        while proc.returncode is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(ProcessDied) as died:
            proc.check_alive()
        assert "this run" in str(died.value)
        assert "earlier run" not in str(died.value)
        assert str(died.value).count("this run") == 1
    assert log.read_text().count("this run") == 2  # the log itself keeps everything
