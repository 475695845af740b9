"""bench/gpu/xpyd_gpu.py counts, per cell, the requests the gateway logged and those decode
computed alone, from the gateway's own access lines."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from bench.gpu.xpyd_gpu import route_counts
from pdplane.gateway.route_note import RouteNote
from pdplane.scheduler import Decision


@dataclass(frozen=True)
class _Ref:
    instance_id: str
    url: str = "http://127.0.0.1:1"
    kv_endpoint: str = "127.0.0.1:2"
    transport: str = "tcp"


def _log_text(notes: list[RouteNote], caplog: pytest.LogCaptureFixture) -> str:
    """The notes' access lines as the gateway's log file has them (logger name before each)."""
    with caplog.at_level(logging.INFO, logger="pdplane.gateway.access"):
        for i, note in enumerate(notes):
            note.log_line("127.0.0.1", "POST", "/v1/completions", 200, f"req-{i}", "m", 9.0)
    return "\n".join(f"INFO {r.name}: {r.getMessage()}" for r in caplog.records)


def test_decode_alone_counts_the_requests_whose_prefill_was_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pair = Decision(_Ref("prefill-0"), _Ref("decode-1"), "kv_aware", 0, 0)
    alone = Decision(None, _Ref("decode-1"), "no prefill: decode holds 8000/8000", 0, 8000)
    notes = [
        RouteNote(pair, prompt_tokens=8000, exact=True),
        RouteNote(alone, prompt_tokens=8000, exact=True),
        RouteNote(alone, prompt_tokens=8000, exact=False),
        RouteNote(None, prompt_tokens=8000, exact=True),  # shed before any decision
    ]
    text = "other line\n" + _log_text(notes, caplog)
    assert route_counts(text) == {"requests": 4, "decode_alone": 2}
