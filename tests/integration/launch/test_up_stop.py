"""Stopping a fleet (`pdplane up`'s Ctrl-C) with streams open: the gateway stops first and
lets them finish on the engines, which stop after it; a stream longer than the gateway's
shutdown bound ends with an error event saying the server is shutting down, then [DONE],
never a 502 nor a cut connection. Sims stand in for vLLM (one token per `--itl-ms`)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdplane.launch.deployment import Fleet
from tests.integration.launch.cli import sim_fleet_spec

ITL_MS = 100
#: The gateway's shutdown bound of these tests (s).
SHUTDOWN_S = 3


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    spec = sim_fleet_spec(
        tmp_path, vllm_args=["--itl-ms", str(ITL_MS)], gateway_shutdown_s=SHUTDOWN_S
    )
    fleet = Fleet(spec)
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()


def _stream_during_stop(fleet: Fleet, max_tokens: int) -> list[str]:
    """The data lines of a streamed completion during which the fleet is stopped (once its
    first token came)."""
    body = {"model": fleet.model_name, "prompt": "hello", "max_tokens": max_tokens}
    body |= {"stream": True, "ignore_eos": True}
    events: list[str] = []
    stopper = threading.Thread(target=fleet.stop)
    with httpx.stream("POST", f"{fleet.gateway_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line.removeprefix("data: "))
            if len(events) == 1:
                stopper.start()
    stopper.join(60)
    return events


def test_a_short_stream_finishes_when_the_fleet_stops(fleet: Fleet) -> None:
    tokens = 10  # 1 s: within the gateway's shutdown bound
    events = _stream_during_stop(fleet, tokens)
    assert events[-1] == "[DONE]", events
    assert not any("error" in json.loads(e) for e in events[:-1]), events
    text = [e for e in events[:-1] if json.loads(e).get("choices")]
    assert len(text) == tokens, events


def test_a_long_stream_ends_with_a_shutting_down_error(fleet: Fleet) -> None:
    tokens = 10 * SHUTDOWN_S * 1000 // ITL_MS  # 10 times the shutdown bound
    events = _stream_during_stop(fleet, tokens)
    assert events[-1] == "[DONE]", events
    error = json.loads(events[-2])["error"]
    assert "shutting down" in error["message"], error
    assert error["code"] != 502, error
    # An expected end of a stream, not a failure: no traceback in the gateway's log.
    log = (fleet.spec.log_dir / "gateway.log").read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log
