"""Peak gateway memory per MB of request body, measured on a gateway in its own process.

A completions prompt of millions of token ids once drove the gateway to ~130 MB of RSS per MB
of body (pydantic union validation of the list); bodies are now bounded by the served model's
length before any object is built (`pdplane.gateway.json_guard`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

#: The bound asserted: peak RSS growth of the gateway process per MB of body.
MAX_RSS_MB_PER_BODY_MB = 8.0
_MB = 1 << 20

_GATEWAY = """
import sys
from pdplane.gateway.testing import running_gateway
from pdplane.scheduler import SchedulerUnavailable
from tests.unit.gateway.conftest import VIEW, FakeScheduler

sched = FakeScheduler([SchedulerUnavailable("no pair")] * 100)
with running_gateway(scheduler_port=sched, fleet=lambda: VIEW) as url:
    print(url, flush=True)
    sys.stdin.read()
"""


def _peak_rss(pid: int) -> int:
    """The process's peak resident set size (bytes), Linux's VmHWM."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.fixture
def gateway_process() -> Iterator[tuple[str, psutil.Process]]:
    if not Path("/proc/self/status").exists():
        pytest.skip("needs Linux /proc for the peak RSS")
    proc = subprocess.Popen(
        [sys.executable, "-c", _GATEWAY],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[3],
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://"), url
        yield url, psutil.Process(proc.pid)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _post(url: str, body: bytes) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=120,
    )


@pytest.mark.parametrize(
    ("kind", "body", "status"),
    [
        # 16 MB of token ids (8M ids), far beyond the model's 4096 tokens: refused unparsed.
        ("token ids", b'{"model": "m", "prompt": [' + b"1," * (8 * _MB) + b"1]}", 400),
        # 16 MB of text: a plausible (if long) prompt, parsed and scheduled (503 here).
        ("text", json.dumps({"model": "m", "prompt": "word, " * (16 * _MB // 6)}).encode(), 503),
    ],
)
def test_peak_rss_per_mb_of_body_is_bounded(
    gateway_process: tuple[str, psutil.Process], kind: str, body: bytes, status: int
) -> None:
    url, proc = gateway_process
    assert _post(url, b'{"model": "m", "prompt": [1, 2, 3]}').status_code == 503  # warm up
    before = _peak_rss(proc.pid)
    r = _post(url, body)
    growth_mb = (_peak_rss(proc.pid) - before) / _MB
    per_mb = growth_mb / (len(body) / _MB)
    print(f"{kind}: body {len(body) / _MB:.1f} MB, peak RSS +{growth_mb:.0f} MB = {per_mb:.2f}/MB")
    assert per_mb <= MAX_RSS_MB_PER_BODY_MB, f"{kind}: {per_mb:.1f} MB of RSS per MB of body"
    assert r.status_code == status, r.text[:300]
    assert r.json()["error"]["code"] == status
    assert proc.is_running()
