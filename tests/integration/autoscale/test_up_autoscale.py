"""`pdplane up --engine sim --autoscale`: a 1P3D fleet of sims moves to more prefill when the
prompts grow and back when they shrink, while serving, with no failed request.

The real `pdplane up` (a subprocess, as a user runs it): registry, scheduler, gateway and
`pdplane sim` instances whose engine profile makes a prompt token cost 1 ms of prefill (the
same profile the controller simulates with). Traffic goes through the gateway: short prompts
(~40 tokens) at 4 req/s, then long ones (~500 tokens: 2 s of prefill work per second, more
than one prefill instance can do), then short ones again. Budget: 5 instances.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdplane.launch.ports import free_port_run
from pdplane.sim.profiles import PROFILES

RATE = 4.0
SHORT, LONG = 40, 500
#: autoscale flags: decide every second on a 6 s window, shrink after 4 s above the line
FLAGS = [
    "--autoscale",
    "--autoscale-interval-s", "1",
    "--autoscale-window-s", "6",
    "--scale-in-after-s", "4",
    "--cooldown-s", "4",
    "--predict-measure-s", "10",
    "--gpus", "5",
    "--max-prefill", "4",
    "--max-decode", "3",
]  # fmt: skip


def _profile(path: Path) -> Path:
    d = PROFILES["tiny-cpu"].to_dict()
    d["name"] = "slow-prefill"
    d["cost"].update(
        step_ms=5.0, prefill_token_ms=1.0, token_ms=0.0, seq_ms=0.2, kv_read_ms_per_ktok=0.0
    )
    path.write_text(json.dumps(d))
    return path


@dataclass
class _Up:
    proc: subprocess.Popen[str]
    gateway: str
    metrics: str  # the controller's Prometheus endpoint
    lines: list[str] = field(default_factory=list)

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        rx = re.compile(pattern)
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if rx.search(line):
                    return line
            assert self.proc.poll() is None, "\n".join(self.lines[-40:])
            time.sleep(0.2)
        raise AssertionError(f"no line matching {pattern!r}:\n" + "\n".join(self.lines[-40:]))


@pytest.fixture
def up(tmp_path: Path) -> Iterator[_Up]:
    base = free_port_run(5)
    vllm, kv = free_port_run(8), free_port_run(8)
    argv = [
        sys.executable, "-m", "pdplane.cli.main", "up",
        "--engine", "sim", "--sim-profile", str(_profile(tmp_path / "slow.json")),
        "--prefill", "1", "--decode", "3",
        "--registry-port", str(base), "--scheduler-port", str(base + 1),
        "--gateway-port", str(base + 2), "--scheduler-metrics-port", str(base + 3),
        "--autoscale-metrics-port", str(base + 4),
        "--vllm-base-port", str(vllm), "--kv-base-port", str(kv),
        "--log-dir", str(tmp_path / "logs"), "--ready-timeout-s", "120",
        *FLAGS,
    ]  # fmt: skip
    env = {**os.environ, "PDPLANE_CACHE_DIR": str(tmp_path / "cache")}
    for name in ("PDPLANE_TOKEN", "PDPLANE_ADMIN_TOKEN", "PDPLANE_REGISTRY_TOKEN"):
        env.pop(name, None)
    out = subprocess.PIPE
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    running = _Up(proc, f"http://127.0.0.1:{base + 2}", f"http://127.0.0.1:{base + 4}/metrics")
    reader = threading.Thread(target=running.read, daemon=True)
    reader.start()
    try:
        running.wait_for(r"serving; Ctrl-C stops everything", 150)
        yield running
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)


@dataclass
class _Traffic:
    """Requests at RATE per second through the gateway; every answer is checked."""

    url: str
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def one(self, words: int, i: int) -> None:
        body = {
            "model": "tiny-llama",
            "prompt": " ".join(f"w{i}x{k}" for k in range(words)),
            "max_tokens": 8,
        }
        try:
            r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)
            if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8:
                self.ok += 1
            else:
                self.failed.append(f"{r.status_code}: {r.text[:200]}")
        except httpx.HTTPError as exc:
            self.failed.append(repr(exc))

    def phase(self, words: int, seconds: float, start: int) -> None:
        t0 = time.monotonic()
        n = int(seconds * RATE)
        for k in range(n):
            delay = t0 + k / RATE - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            t = threading.Thread(target=self.one, args=(words, start + k), daemon=True)
            t.start()
            self.threads.append(t)

    def join(self) -> None:
        for t in self.threads:
            t.join(150)


def _counts(line: str) -> tuple[int, int]:
    """The wanted (prefill, decode) of a decision line."""
    m = re.search(r"-> (\d+)P(\d+)D", line)
    assert m, line
    return int(m.group(1)), int(m.group(2))


def test_more_prefill_when_prompts_grow_and_back_with_no_failed_request(up: _Up) -> None:
    traffic = _Traffic(up.gateway)
    traffic.phase(SHORT, 8, 0)
    traffic.phase(LONG, 25, 1000)
    # A prefill instance started by the controller serves before the long prompts stop.
    up.wait_for(r"prefill-\d+ \(prefill\) healthy and registered: serving", 30)
    peak = max(_counts(ln)[0] for ln in _decisions(up))
    assert peak >= 2, "\n".join(up.lines[-40:])
    # The controller's metrics say what it wants and what it did.
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(up.metrics).text)}
    wanted = {
        s.labels["role"]: s.value for s in families["pdplane_autoscale_wanted_instances"].samples
    }
    assert wanted["prefill"] >= 2
    moves = families["pdplane_autoscale_moves"].samples
    assert any(s.labels["role"] == "prefill" and s.value >= 1 for s in moves), moves
    traffic.phase(SHORT, 20, 2000)
    traffic.join()
    up.wait_for(r"\(prefill\) drained \(idle\) after", 20)
    assert traffic.failed == [], traffic.failed[:5]
    assert traffic.ok == int(8 * RATE) + int(25 * RATE) + int(20 * RATE)
    last = _decisions(up)[-1]
    assert _counts(last)[0] < peak and "prefill above the plan" in last, last


def _decisions(up: _Up) -> list[str]:
    return [ln for ln in up.lines if re.search(r"\dP\dD -> \dP\dD: ", ln)]
