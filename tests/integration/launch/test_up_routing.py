"""`pdplane up` says `ready` only once the gateway routes the served model as it will: with
instances that publish a tokenizer, precise routing is on when the line is printed, and the
banner says so; with instances that publish none, it says at once that routing is by load
and why (no wait for a tokenizer that will not come). Sims stand in for vLLM (`--engine sim`;
with `--model DIR` they publish DIR's tokenizer as the connector does)."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.integration.launch.cli import UP_PORT_FLAGS, free_ports, line_queue


def _up(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[str], queue.Queue[str], str]:
    ports = free_ports(*UP_PORT_FLAGS, "scheduler-metrics-port")
    argv = [sys.executable, "-m", "pdplane.cli.main", "up", "--engine", "sim"]
    argv += ["--log-dir", str(tmp_path / "logs"), *extra]
    for name, port in ports.items():
        argv += [f"--{name}", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    return proc, line_queue(proc.stdout), f"http://127.0.0.1:{ports['gateway-port']}"


def _until(lines: queue.Queue[str], needle: str) -> list[str]:
    """Lines up to and including the first holding `needle` (fails at the end of output)."""
    seen: list[str] = []
    while True:
        line = lines.get(timeout=180)
        assert line, "".join(seen)
        seen.append(line)
        if needle in line:
            return seen


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()


def test_ready_comes_once_routing_is_precise(tmp_path: Path, tiny_model: Path) -> None:
    # Sims run no weights: `--model` gives them the model's tokenizer, which they publish.
    proc, lines, gateway = _up(tmp_path, "--model", str(tiny_model))
    try:
        _until(lines, "] ready in ")
        entry = httpx.get(f"{gateway}/health", timeout=5).json()["models"][tiny_model.name]
        assert entry["routing"] == "precise", entry
        banner = _until(lines, "serving;")
        assert any("routing:" in line and "precise" in line for line in banner), banner
    finally:
        _stop(proc)


def test_without_a_published_tokenizer_ready_says_routing_is_by_load(tmp_path: Path) -> None:
    proc, lines, gateway = _up(tmp_path)
    try:
        banner = _until(lines, "serving;")
        (said,) = [line for line in banner if "routing:" in line]
        assert "by load" in said and "publishes its tokenizer" in said, said
        # ... and how to have it with sims, in a form `pdplane up` takes.
        assert any("sims publish a tokenizer with --model DIR" in line for line in banner), banner
        entry = httpx.get(f"{gateway}/health", timeout=5).json()["models"]["tiny-llama"]
        assert entry["routing"] == "load", entry
    finally:
        _stop(proc)
