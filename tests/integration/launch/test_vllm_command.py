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
from tests.integration.registry.fixtures import running_registry

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
# A stand-in that also registers, as the connector does, at the URL `pdplane vllm` advertises,
# and says on stderr when the registry has it. It registers a moment after it answers
# /health (the connector registers only once the server answers), so a `ready` line that
# does not wait for the registry comes before "stand-in: registered".
_REGISTERING = _SERVER.replace(
    "    server.serve_forever()",
    textwrap.indent(
        textwrap.dedent(
            """
            import json, threading, time
            from pdplane.registry.client import RegistrationClient
            from pdplane.v1 import instance_pb2
            from tests.integration.registry.fixtures import make_spec
            config = json.loads(sys.argv[sys.argv.index("--kv-transfer-config") + 1])
            url = config["kv_connector_extra_config"]["url"]
            registry = config["kv_connector_extra_config"]["registry"]
            def register():
                time.sleep(1.0)
                spec = make_spec("stand-in", instance_pb2.ROLE_DECODE, url=url)
                RegistrationClient(registry, spec).start()
                sys.stderr.write("stand-in: registered\\n")
                sys.stderr.flush()
            threading.Thread(target=register, daemon=True).start()
            server.serve_forever()
            """
        ),
        "    ",
    ),
)
# `pdplane vllm` with the stand-in in place of vLLM's server; REGISTERED_WITHIN_S (s) bounds
# its wait for the registry to list the instance.
_COMMAND = textwrap.dedent(
    """
    import os, sys
    from pdplane.cli import vllm
    from pdplane.launch import vllm_cpu
    server = sys.argv.pop(1)
    vllm_cpu.serve_argv = lambda python, model: [python, server]
    vllm._REGISTERED_WITHIN_S = float(os.environ.get("REGISTERED_WITHIN_S", "30"))
    sys.exit(vllm.main(sys.argv[1:]))
    """
)


def _start(
    tmp_path: Path,
    *extra: str,
    server: str = _SERVER,
    registry: str = "127.0.0.1:1",
    registered_within_s: float = 30.0,
) -> subprocess.Popen[str]:
    (tmp_path / "server.py").write_text(server)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv = [sys.executable, "-c", _COMMAND, str(tmp_path / "server.py"), "--role", "decode"]
    argv += ["--model", str(tmp_path), "--port", str(free_port_run())]
    argv += ["--kv-port", str(free_port_run()), "--registry", registry, *extra]
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp), "PYTHONPATH": ":".join(sys.path)}
    env["REGISTERED_WITHIN_S"] = str(registered_within_s)
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
    with running_registry(port=0) as registry:
        proc = _start(tmp_path, server=_REGISTERING, registry=registry)
        lines = _lines(proc)
        try:
            said = [lines.get(timeout=60) for _ in range(3)]
            assert "starting" in said[0], said
            # Ready only once the registry lists it, so a client can be routed to it.
            assert said[1] == "stand-in: registered\n", said
            assert said[2].startswith("pdplane vllm: ready in "), said
            assert "/v1" in said[2] and "not yet listed" not in said[2], said
            assert len(_events_dirs(tmp_path)) == 1  # the server's, while it runs
            proc.send_signal(stop)
            assert proc.wait(timeout=30) == 0
        finally:
            proc.kill()
    assert _events_dirs(tmp_path) == []


def test_ready_line_says_when_the_registry_does_not_list_the_instance(tmp_path: Path) -> None:
    with running_registry(port=0) as registry:  # the stand-in never registers
        proc = _start(tmp_path, registry=registry, registered_within_s=1.0)
        lines = _lines(proc)
        try:
            said = [lines.get(timeout=60), lines.get(timeout=60)]
            assert said[1].startswith("pdplane vllm: ready in "), said
            assert f"not yet listed by the registry at {registry}" in said[1], said
        finally:
            proc.kill()


def test_a_server_that_exits_by_itself_leaves_no_events_folder(tmp_path: Path) -> None:
    proc = _start(tmp_path, "--vllm-args", "exit")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1, err  # exited 0 unasked: a failure for restart policies
    assert "ready" not in err, err
    assert _events_dirs(tmp_path) == []
