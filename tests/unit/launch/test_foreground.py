"""pdplane.launch.foreground: `pdplane vllm`'s supervision of the vLLM server, with stand-in
processes: a terminal's Ctrl-C reaches the server alone (never its engine), the rest of its
process group is ended after it, and a SIGKILLed supervisor takes the server along."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil

from pdplane.launch.process import wait_until

# The "server": on SIGINT it stops its "engine" (a child in its process group) with SIGTERM,
# as vLLM's API server does, and exits 0. The engine records any SIGINT it receives itself.
_SERVER = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    from pathlib import Path
    out = Path(sys.argv[1])
    engine = subprocess.Popen([sys.executable, "-c", '''
    import signal, sys, time
    from pathlib import Path
    signal.signal(signal.SIGINT, lambda *_: Path(sys.argv[1]).write_text("engine got SIGINT"))
    while True:
        time.sleep(0.1)
    ''', str(out.with_suffix(".engine"))])
    def stop(*_):
        engine.terminate(); engine.wait(); out.write_text("server stopped"); sys.exit(0)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    Path(str(out) + ".pid").write_text(f"{engine.pid}")
    if len(sys.argv) > 2:
        sys.exit(0)  # exits on its own, as vLLM's API server does after its engine died
    while True:
        time.sleep(0.1)
    """
)
_SUPERVISOR = textwrap.dedent(
    """
    import sys
    from pdplane.launch.foreground import run_in_foreground
    sys.exit(run_in_foreground([sys.executable, *sys.argv[1:]]))
    """
)


# The supervisor with one more thread (as gRPC's or `pdplane vllm`'s ready-line thread are)
# that takes the stop signal itself once the server runs: Linux hands a process-directed
# signal to any thread, and a main thread blocked in waitpid() never learns of it.
_SUPERVISOR_SIGNALLED_ON_A_THREAD = textwrap.dedent(
    """
    import signal, sys, threading
    from pathlib import Path
    from pdplane.launch.foreground import run_in_foreground
    from pdplane.launch.process import wait_until
    pid_file = Path(sys.argv[2] + ".pid")
    def stop_from_this_thread():
        wait_until(lambda: pid_file.exists() and pid_file.read_text() != "", 30.0, what="engine")
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
    threading.Thread(target=stop_from_this_thread, daemon=True).start()
    sys.exit(run_in_foreground([sys.executable, *sys.argv[1:]]))
    """
)


def _start(
    tmp_path: Path, *server_args: str, supervisor: str = _SUPERVISOR
) -> tuple[subprocess.Popen[bytes], Path]:
    (tmp_path / "server.py").write_text(_SERVER)
    out = tmp_path / "out"
    argv = [sys.executable, "-c", supervisor, str(tmp_path / "server.py"), str(out), *server_args]
    # Its own session, like a terminal's foreground job; SIGINT to the group = Ctrl-C.
    return subprocess.Popen(argv, start_new_session=True), out


def _engine_pid(out: Path) -> int:
    pid_file = Path(str(out) + ".pid")
    wait_until(lambda: pid_file.exists() and pid_file.read_text() != "", 30.0, what="engine")
    return int(pid_file.read_text())


def _engine(out: Path) -> psutil.Process:
    return psutil.Process(_engine_pid(out))


def test_ctrl_c_reaches_the_server_alone_which_stops_its_engine(tmp_path: Path) -> None:
    supervisor, out = _start(tmp_path)
    engine = _engine(out)
    os.killpg(supervisor.pid, signal.SIGINT)
    assert supervisor.wait(timeout=30) == 0
    engine.wait(timeout=10)
    assert out.read_text() == "server stopped"
    assert not out.with_suffix(".engine").exists()  # the engine never saw the Ctrl-C


def test_a_stop_signal_taken_by_another_thread_still_stops_the_server(tmp_path: Path) -> None:
    supervisor, out = _start(tmp_path, supervisor=_SUPERVISOR_SIGNALLED_ON_A_THREAD)
    # Only its pid: the supervisor's thread stops everything as soon as the pid file is
    # written, so the engine may be gone before a psutil handle could be taken on it.
    engine_pid = _engine_pid(out)
    try:
        assert supervisor.wait(timeout=30) == 0
    finally:
        supervisor.kill()
    # The server reaps its engine before writing "server stopped" and exiting.
    assert out.read_text() == "server stopped"
    assert not psutil.pid_exists(engine_pid)


def test_a_sigkilled_supervisor_takes_the_server_and_its_engine_along(tmp_path: Path) -> None:
    supervisor, out = _start(tmp_path)
    engine = _engine(out)
    server = psutil.Process(supervisor.pid).children()[0]
    supervisor.kill()
    supervisor.wait(timeout=10)
    server.wait(timeout=10)
    engine.wait(timeout=10)
    assert out.read_text() == "server stopped"


def test_a_server_exiting_unasked_is_a_failure(tmp_path: Path) -> None:
    supervisor, out = _start(tmp_path, "exit-now")
    engine = _engine(out)
    assert supervisor.wait(timeout=30) == 1
    engine.wait(timeout=10)  # left behind by the server, ended by the supervisor
