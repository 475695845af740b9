"""pdplane.connector.lifeline: an engine-like multiprocessing child exits when its parent is
SIGKILLed, after running its clean-up (the connector deregisters there)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from pdplane.connector.lifeline import watch_parent
from pdplane.launch.process import wait_until

_PARENT = textwrap.dedent(
    """
    import multiprocessing, sys, time
    from pathlib import Path

    def engine(marker: str, pid_file: str) -> None:
        from pdplane.connector.lifeline import watch_parent
        assert watch_parent(lambda: Path(marker).write_text("cleaned up"), grace_s=5.0)
        Path(pid_file).write_text(str(multiprocessing.current_process().pid))
        time.sleep(120)

    if __name__ == "__main__":
        ctx = multiprocessing.get_context(sys.argv[1])
        child = ctx.Process(target=engine, args=(sys.argv[2], sys.argv[3]))
        child.start()
        time.sleep(120)
    """
)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_child_exits_after_clean_up_when_its_parent_is_killed(tmp_path: Path, method: str) -> None:
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    marker, pid_file = tmp_path / "marker", tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, str(script), method, str(marker), str(pid_file)])
    try:
        wait_until(lambda: pid_file.exists() and pid_file.read_text() != "", 60.0, what="child")
        child = psutil.Process(int(pid_file.read_text()))
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        child.wait(timeout=10)  # raises TimeoutExpired if the child outlived its parent
        assert marker.read_text() == "cleaned up"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_process_without_multiprocessing_parent_has_nothing_to_watch() -> None:
    assert watch_parent(lambda: None) is False
