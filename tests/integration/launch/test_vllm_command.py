"""`pdplane vllm` around a stand-in vLLM server (an HTTP server answering /health, started
with the argv `pdplane vllm` builds): it prints one ready line once the server answers, and
whatever stops it (SIGTERM, SIGINT, the server exiting) it removes the private folder of the
KV events socket it made for the server."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pdplane.launch.ports import free_port_run
from tests.integration.launch.cli import line_queue

# The stand-in server: binds the --port of its argv, answers GET /health 200, exits 0 on
# SIGTERM or SIGINT (as vLLM's API server does) and at once on its own with "exit" in its argv.
_SERVER = textwrap.dedent(
    """
    import http.server, signal, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *args):
            pass
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, lambda *_: sys.exit(0))
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    if "exit" not in sys.argv:
        server.serve_forever()
    """
)
# `pdplane vllm` with the stand-in in place of vLLM's server.
_COMMAND = textwrap.dedent(
    """
    import sys
    from pdplane.cli import vllm
    from pdplane.launch import vllm_cpu
    server = sys.argv.pop(1)
    vllm_cpu.serve_argv = lambda python, model: [python, server]
    sys.exit(vllm.main(sys.argv[1:]))
    """
)


def _start(tmp_path: Path, *extra: str) -> subprocess.Popen[str]:
    (tmp_path / "server.py").write_text(_SERVER)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv = [sys.executable, "-c", _COMMAND, str(tmp_path / "server.py"), "--role", "decode"]
    argv += ["--model", str(tmp_path), "--port", str(free_port_run())]
    argv += ["--kv-port", str(free_port_run()), "--registry", "127.0.0.1:1", *extra]
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp), "PYTHONPATH": ":".join(sys.path)}
    return subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env)


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    """`proc`'s stderr lines as they come ("" at its end), so that a wait for one is bounded."""
    assert proc.stderr is not None
    return line_queue(proc.stderr)


def _events_dirs(tmp_path: Path) -> list[Path]:
    return list((tmp_path / "tmp").glob("pdplane-kvev-*"))


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_ready_line_then_a_stop_signal_leaves_no_events_folder(
    tmp_path: Path, stop: signal.Signals
) -> None:
    proc = _start(tmp_path)
    lines = _lines(proc)
    try:
        said = [lines.get(timeout=30), lines.get(timeout=30)]
        assert "starting" in said[0], said
        assert said[1].startswith("pdplane vllm: ready in "), said
        assert "/v1" in said[1], said
        assert len(_events_dirs(tmp_path)) == 1  # the server's, while it runs
        proc.send_signal(stop)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    assert _events_dirs(tmp_path) == []


def test_a_server_that_exits_by_itself_leaves_no_events_folder(tmp_path: Path) -> None:
    proc = _start(tmp_path, "--vllm-args", "exit")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1, err  # exited 0 unasked: a failure for restart policies
    assert "ready" not in err, err
    assert _events_dirs(tmp_path) == []
