"""Small clients the connector's end-to-end tests share: completions, metrics, log lines."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import httpx

MODEL = "tiny"
VOCAB = 2048


def fresh_prompt(seed: int, num_tokens: int = 512) -> list[int]:
    """A prompt of `num_tokens` token ids no other test uses (vLLM's prefix cache would answer
    a repeated prompt before the connector is asked). Ids avoid the special tokens (0..5)."""
    rng = random.Random(seed)
    return [rng.randrange(8, VOCAB) for _ in range(num_tokens)]


def complete(
    url: str,
    prompt: list[int],
    max_tokens: int = 12,
    kv_transfer_params: dict[str, Any] | None = None,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """POST /v1/completions (greedy, non-streaming); raises for a non-200 answer."""
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


def text(response: dict[str, Any]) -> str:
    return str(response["choices"][0]["text"])


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the Prometheus samples `name` at `url`/metrics whose labels include `labels`."""
    body = httpx.get(f"{url}/metrics", timeout=10.0).text
    total = 0.0
    for line in body.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"^([a-zA-Z_:]+)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def log_lines(path: Path, needle: str) -> list[str]:
    """Lines of a log file containing `needle`."""
    return [ln for ln in path.read_text(errors="replace").splitlines() if needle in ln]
