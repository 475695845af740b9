"""`pdplane gateway` as a process: flags, serving, and a shutdown that releases open requests."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable

import httpx

from pdplane.launch.ports import free_port_run
from tests.integration.gateway.conftest import MODEL, Stack, wait_for


def test_gateway_command_serves_and_shuts_down_cleanly(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory()
    assert stack.scheduler is not None
    sims = stack.sims(["prefill", "decode"], itl_ms=100)
    stack.wait_ready(sims)
    port = free_port_run()
    cmd = [sys.executable, "-m", "pdplane.cli.main", "gateway", "--scheduler",
           stack.scheduler.address, "--registry", stack.registry, "--port", str(port),
           "--shutdown-timeout-s", "1", "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(healthy, 20, "the gateway process to serve /health")
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=10).status_code == 200

        # A long stream still open at shutdown is cancelled after the grace period and released.
        with httpx.stream("POST", f"{url}/v1/completions", timeout=10,
                          json={**body, "max_tokens": 1000, "stream": True}) as r:  # fmt: skip
            assert r.status_code == 200
            next(r.iter_raw())
            assert stack.scheduler_inflight() == 1
            # The first token is prefill's: the stream is open at decode once decode has it.
            wait_for(lambda: len(sims[1].records()) == 2, 5, "decode to have the stream")
            proc.send_signal(signal.SIGINT)
            assert proc.wait(10) == 0
        wait_for(lambda: stack.scheduler_inflight() == 0, 2, "the open stream to be released")
        wait_for(lambda: sims[1].records()[-1]["cancelled"], 2, "decode to see the cancel")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def test_gateway_command_with_embedded_scheduler(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(embedded=True)
    sims = stack.sims(["prefill", "decode"])
    stack.wait_ready(sims)
    port = free_port_run()
    cmd = [sys.executable, "-m", "pdplane.cli.main", "gateway", "--scheduler", "embedded",
           "--decode-policy", "round_robin", "--registry", stack.registry, "--port", str(port),
           "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(healthy, 20, "the gateway process to serve /health")
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=10).status_code == 200
        # The scheduler's own metrics, served by the gateway, under the same names.
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert (
            'pdplane_scheduler_decisions_total{decode_policy="round_robin",'
            'prefill_policy="kv_aware"} 1.0' in metrics
        )
        assert 'pdplane_scheduler_releases_total{known="true",outcome="success"} 1.0' in metrics
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def test_embedded_scheduler_rejects_an_unknown_policy() -> None:
    cmd = [sys.executable, "-m", "pdplane.cli.main", "gateway", "--scheduler", "embedded",
           "--prefill-policy", "fastest"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "unknown policy 'fastest'" in done.stderr
