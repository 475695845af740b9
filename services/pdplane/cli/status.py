"""`pdplane status`: how a gateway serves each model — usable pairs and how it routes.

    pdplane status [--gateway URL] [--json]

Reads the gateway's `GET /health` (no credentials needed) and prints one line per model:
its SERVING prefill and decode instances, whether they make a usable pair, and its routing:
`precise` (the gateway has the model's tokenizer: exact prompt ids and prefix block hashes,
KV-aware routing) or `load` (by load only), with the reason. Exit codes: 0 the gateway
answered (whatever its health), 1 it did not, 2 bad flags.
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

import httpx
from pydantic import Field

from pdplane.core import defaults
from pdplane.core.settings import CommandSettings

__all__ = ["StatusSettings", "format_status", "main"]


class StatusSettings(CommandSettings):
    """Flags of `pdplane status` (each also a `PDPLANE_*` environment variable)."""

    gateway: str = Field(
        f"http://127.0.0.1:{defaults.GATEWAY_PORT}", description="the gateway's base URL"
    )
    json_: bool = Field(False, alias="json", description="print the /health body as JSON")
    timeout_s: float = Field(5.0, gt=0, description="deadline of the request (s)")


_COLUMNS = ("MODEL", "PREFILL", "DECODE", "PAIRED", "ROUTING", "REASON")


def format_status(health: dict[str, Any]) -> str:
    """An aligned table of a gateway's /health body, one line per model, then its status."""
    rows = [_COLUMNS]
    for name, m in sorted((health.get("models") or {}).items()):
        rows.append(
            (
                name,
                str(m.get("prefill", "?")),
                str(m.get("decode", "?")),
                "yes" if m.get("paired") else "no",
                str(m.get("routing", "?")),
                str(m.get("routing_reason", "")),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS) - 1)]
    lines = [
        "  ".join([*(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)), r[-1]]).rstrip()
        for r in rows
    ]
    status = f"gateway: {health.get('status', '?')}"
    if health.get("reason"):
        status += f" ({health['reason']})"
    return "\n".join([*lines, status]) + "\n"


def main(argv: list[str], out: TextIO | None = None) -> int:
    """Runs `pdplane status`; returns the exit code."""
    s = StatusSettings.parse(argv)
    out = out or sys.stdout
    url = f"{s.gateway.rstrip('/')}/health"
    try:
        resp = httpx.get(url, timeout=s.timeout_s)
        health = resp.json()
    except (httpx.HTTPError, ValueError) as exc:
        sys.stderr.write(f"pdplane status: no answer from {url}: {exc}\n")
        return 1
    out.write(json.dumps(health, indent=2) + "\n" if s.json_ else format_status(health))
    return 0
