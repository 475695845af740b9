"""The access log line of a request says where it went and what was predicted, and never shows
a prediction that was not made as a zero."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from pdplane.gateway.route_note import RouteNote
from pdplane.scheduler import Decision


@dataclass(frozen=True)
class _Ref:
    instance_id: str
    url: str = "http://127.0.0.1:1"
    kv_endpoint: str = "127.0.0.1:2"
    transport: str = "tcp"


def _line(note: RouteNote, caplog: pytest.LogCaptureFixture) -> str:
    with caplog.at_level(logging.INFO, logger="pdplane.gateway.access"):
        note.log_line("127.0.0.1", "POST", "/v1/completions", 200, "req-1", "tiny", 12.5)
    (record,) = caplog.records
    return record.getMessage()


def test_a_pair_with_prompt_ids_shows_both_predicted_hits(caplog: pytest.LogCaptureFixture) -> None:
    decision = Decision(_Ref("prefill-0"), _Ref("decode-1"), "kv_aware", 512, 0)
    line = _line(RouteNote(decision, prompt_tokens=600, exact=True), caplog)
    assert "prompt_tokens=600 exact prefill=prefill-0 cached=512 decode=decode-1 cached=0" in line


def test_a_skipped_prefill_says_so_and_shows_no_prefill_hit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    decision = Decision(None, _Ref("decode-1"), "no prefill: decode holds 512/520", 0, 512)
    line = _line(RouteNote(decision, prompt_tokens=520, exact=True), caplog)
    assert "prefill=skipped decode=decode-1 cached=512" in line, line
    assert "prefill=none" not in line and "cached=0" not in line, line


def test_without_prompt_ids_the_hits_are_unknown_not_zero(
    caplog: pytest.LogCaptureFixture,
) -> None:
    decision = Decision(_Ref("prefill-0"), _Ref("decode-1"), "least_loaded", 0, 0)
    line = _line(RouteNote(decision, prompt_tokens=40, exact=False), caplog)
    assert "estimated prefill=prefill-0 decode=decode-1 cached=unknown" in line, line
    assert "cached=0" not in line, line
