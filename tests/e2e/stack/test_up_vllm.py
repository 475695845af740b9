"""`pdplane up` as a user runs it: real processes, real vLLM CPU pair, a demo request; a decode
instance that dies is reported while the rest keeps serving; then SIGTERM stops everything and
leaves no process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from pdplane.launch.process import wait_until
from tests.e2e.conftest import _free_port

pytestmark = pytest.mark.vllm


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_up_serves_a_demo_request_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    ports = {name: str(_free_port()) for name in ("gateway", "registry", "scheduler")}
    base = _free_port()
    log = tmp_path / "up.out"
    argv = [
        sys.executable,
        "-m",
        "pdplane.cli.main",
        "up",
        "--demo",
        "--gateway-port",
        ports["gateway"],
        "--registry-port",
        ports["registry"],
        "--scheduler-port",
        ports["scheduler"],
        # vLLM and KV ports count up from these bases, one per instance.
        "--vllm-base-port",
        str(base),
        "--kv-base-port",
        str(base + 10),
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    with log.open("wb") as out:
        up = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        wait_until(
            lambda: "serving; Ctrl-C" in log.read_text(),
            600.0,
            interval_s=1.0,
            what="`pdplane up` to report it is serving",
        )
        text = log.read_text()
        assert re.search(r"ready in \d+ s", text), text
        assert f"http://127.0.0.1:{ports['gateway']}/v1" in text
        answer = re.search(r"answer: '(.*)'", text)
        assert answer and answer.group(1).strip(), text
        children = _descendants(up.pid)
        assert len(children) >= 5  # registry, scheduler, gateway, prefill, decode
        decode = next(c for c in children if "kv_consumer" in " ".join(c.cmdline()))
        os.killpg(decode.pid, signal.SIGKILL)
        wait_until(
            lambda: "decode-1 exited" in log.read_text(),
            30.0,
            what="`pdplane up` to report the dead decode instance",
        )
        assert up.poll() is None, log.read_text()
        models = httpx.get(f"http://127.0.0.1:{ports['gateway']}/v1/models", timeout=10)
        assert models.status_code == 200
        children = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0, log.read_text()
        deadline = time.monotonic() + 10
        alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [c for c in alive if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert alive == [], [c.cmdline()[:4] for c in alive]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(timeout=30)
        for child in _descendants(up.pid):
            child.kill()
