"""`pdplane up` as a user runs it: real processes, real vLLM CPU pair, a demo request; a decode
instance whose API server is SIGKILLed takes its engine along, the gateway's /health says so
within about a second (not the lease TTL), and the instance is restarted and serves again; a
registry that dies is restarted and the instances come back to it; a second `pdplane up` on the
same ports fails at once; then SIGTERM stops everything cleanly and leaves no process behind."""

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

from pdplane.core import defaults
from pdplane.launch.ports import free_port_run
from pdplane.launch.process import wait_until

_PORT_BLOCK = 2  # `pdplane up` counts vLLM (and KV) ports up from a base: one per instance
#: The gateway reports the lost pair this fast after an instance's API server died (the
#: registry's lease TTL would take 5 s).
_UNHEALTHY_WITHIN_S = defaults.LEASE_TTL_MS / 1000 / 2


pytestmark = pytest.mark.vllm


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _ls(registry_port: str) -> str:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdplane.cli.main",
            "ls",
            "--registry",
            f"127.0.0.1:{registry_port}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    _last_ls[:] = [f"rc={out.returncode}\n{out.stdout}{out.stderr}"]
    return out.stdout


#: the last `_ls` output, for the message of a wait that timed out
_last_ls: list[str] = []


def test_up_serves_a_demo_request_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    ports = {
        name: str(free_port_run())
        for name in ("gateway", "registry", "scheduler", "scheduler-metrics")
    }
    vllm_base = free_port_run(_PORT_BLOCK)
    kv_base = free_port_run(_PORT_BLOCK)
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
        "--scheduler-metrics-port",
        ports["scheduler-metrics"],
        "--vllm-base-port",
        str(vllm_base),
        "--kv-base-port",
        str(kv_base),
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    with log.open("wb") as out:
        up = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:

        def serving() -> bool:
            assert up.poll() is None, f"`pdplane up` exited:\n{log.read_text()}"
            return "serving; Ctrl-C" in log.read_text()

        wait_until(
            serving,
            600.0,
            interval_s=1.0,
            what="`pdplane up` to report it is serving",
        )
        text = log.read_text()
        assert re.search(r"ready in \d+ s", text), text
        assert f"http://127.0.0.1:{ports['gateway']}/v1" in text
        answer = re.search(r"answer: '(.*)'", text)
        assert answer and answer.group(1).strip(), text
        # The scheduler's metrics are served, at the address the banner gives.
        metrics = f"http://127.0.0.1:{ports['scheduler-metrics']}/metrics"
        assert f"scheduler metrics:    {metrics}" in text, text
        assert "pdplane_scheduler_decisions" in httpx.get(metrics, timeout=5).text

        # No tokenizer flag anywhere: the gateway routes precisely with the instances' own.
        def routing() -> str:
            health = httpx.get(f"http://127.0.0.1:{ports['gateway']}/health", timeout=5).json()
            return str(health["models"].get("tiny-llama", {}).get("routing"))

        wait_until(lambda: routing() == "precise", 30.0, what="precise routing")
        children = _descendants(up.pid)
        assert len(children) >= 5  # registry, scheduler, gateway, prefill, decode
        gateway = f"http://127.0.0.1:{ports['gateway']}"
        decode = next(c for c in children if "kv_consumer" in " ".join(c.cmdline()))
        engine = decode.children()
        assert engine, "the decode API server has an engine core process"
        decode.kill()  # the API server alone: its engine core must not outlive it
        killed = time.monotonic()
        wait_until(
            lambda: httpx.get(f"{gateway}/health", timeout=5).status_code == 503,
            10.0,
            interval_s=0.05,
            what="the gateway to report no usable pair",
        )
        took = time.monotonic() - killed
        assert took < _UNHEALTHY_WITHIN_S, f"/health said 503 only {took:.1f} s after the kill"
        psutil.wait_procs(engine, timeout=20)
        assert not [p for p in engine if p.is_running() and p.status() != "zombie"]
        wait_until(
            lambda: "decode-1 exited with status -9; restarting it" in log.read_text(),
            30.0,
            what="`pdplane up` to restart the dead decode instance",
        )
        wait_until(
            lambda: "decode-1 healthy again" in log.read_text(),
            300.0,
            interval_s=1.0,
            what="the restarted decode instance to serve",
        )
        wait_until(
            lambda: httpx.get(f"{gateway}/health", timeout=5).status_code == 200,
            30.0,
            what="the gateway to report a usable pair again",
        )
        body = {"model": "tiny-llama", "prompt": "The restarted decode", "max_tokens": 4}
        answer = httpx.post(f"{gateway}/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        assert up.poll() is None, log.read_text()
        # A crashed registry is restarted on its port; the prefill re-registers by itself.
        registry = next(c for c in children if " registry " in f" {' '.join(c.cmdline())} ")
        registry.kill()
        wait_until(
            lambda: "registry exited with status -9; restarting it" in log.read_text(),
            30.0,
            what="`pdplane up` to restart the registry",
        )
        try:
            wait_until(
                lambda: "prefill-0" in _ls(ports["registry"]),
                30.0,
                what="prefill-0 to re-register with the restarted registry",
            )
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; the last pdplane ls: {_last_ls}") from None
        assert up.poll() is None, log.read_text()
        # A second `pdplane up` on the same ports fails at once and says why (bad input: 2).
        second = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stdout
        assert f"{ports['registry']} (registry)" in second.stdout, second.stdout
        assert "healthy" not in second.stdout and " up (" not in second.stdout, second.stdout
        children = _descendants(up.pid)  # the restarted registry and decode included
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0, log.read_text()
        for instance_log in (tmp_path / "logs").glob("*-[0-9].log"):
            # Stopped by its API server, not by a signal of its own (see the lifecycle tests).
            text = instance_log.read_text()
            assert "EngineCore: trigger received signal=SIGINT" not in text, instance_log.name
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
