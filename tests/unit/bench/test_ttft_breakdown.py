"""bench/vllm_cpu/ttft_breakdown.py's phase arithmetic on hand-built traces of each dispatch/KV
mode."""

from __future__ import annotations

import math

from bench.vllm_cpu.ttft_breakdown import PHASES, breakdown, median_present
from tests.support.otlp import ReceivedSpan

MS = 1_000_000  # ns


def _span(name: str, sid: str, parent: str, start_ms: float, end_ms: float) -> ReceivedSpan:
    attrs = {"gen_ai.latency.time_to_first_token": 0.010, "gen_ai.latency.time_in_queue": 0.004}
    return ReceivedSpan(name, "t", sid, parent, "svc", int(start_ms * MS), int(end_ms * MS), attrs)


def _trace(decode_leg_start_ms: float, served: bool) -> list[ReceivedSpan]:
    """Request 0-40 ms; prefill leg 3-17 ms; the decode leg from `decode_leg_start_ms` to its
    headers at 20 ms; pull 22-27 ms (`served`: prefill served it); first byte at 35 ms."""
    spans = [
        _span("pdplane.request", "r", "", 0, 40),
        _span("pdplane.schedule", "s", "r", 1, 3),
        _span("pdplane.scheduler.decision", "sd", "s", 1.5, 2),
        _span("pdplane.prefill_leg", "p", "r", 3, 17),
        _span("llm_request", "pv", "p", 4, 15),
        _span("pdplane.decode_leg", "d", "r", decode_leg_start_ms, 20),
        _span("llm_request", "dv", "d", 18, 36),
        _span("pdplane.kv_pull", "k", "dv", 22, 27),
        _span("pdplane.first_byte", "f", "r", 20, 35),
    ]
    if served:
        spans.append(_span("pdplane.kv_serve", "ks", "k", 23, 25))
    return spans


def test_sequential_pull_has_every_phase() -> None:
    got = breakdown(_trace(17.5, served=True), client_ttft_ms=37.0)
    assert set(got) == set(PHASES)
    assert got["between legs (gateway)"] == 0.5
    assert got["  leg start -> prefill vLLM arrival"] == 1.0
    assert got["  prefill vLLM end -> answer at gateway"] == 2.0
    assert got["decode leg (send -> headers)"] == got["  of it after prefill's answer"] == 2.5
    assert got["  prefill kv_serve"] == 2.0
    assert got["decode admission (arrival -> pull start)"] == 4.0
    assert got["pull end -> first byte at gateway"] == 8.0
    assert got["relay (gateway first byte -> client)"] == 2.0
    assert got["decode side (prefill's answer -> first byte)"] == 18.0


def test_concurrent_push_marks_the_spans_it_has_not() -> None:
    """Decode leg opened at 3 ms (before prefill answered at 17 ms), no kv_serve (a push)."""
    got = breakdown(_trace(3.0, served=False), client_ttft_ms=37.0)
    assert math.isnan(got["between legs (gateway)"])
    assert math.isnan(got["  prefill kv_serve"])
    assert got["decode leg (send -> headers)"] == 17.0
    assert got["  of it after prefill's answer"] == 3.0
    assert got["KV transfer (kv_pull)"] == 5.0


def test_median_skips_missing_spans() -> None:
    assert median_present([1.0, math.nan, 3.0]) == 2.0
    assert math.isnan(median_present([math.nan]))
