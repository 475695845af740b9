"""Must show: no decode for a moment is not an error.

1P1D, the decode a `pdplane sim` process SIGKILLed under a steady trickle of requests and
started again a few seconds later (same instance id and port, as `pdplane up` restarts it):
every request answers 200; those that came while no decode served waited in the admission
queue (up to `--queue-timeout-s`) instead of getting 503 at once, and those that had already
been sent to the dead decode before its lease expired waited too (retried once the fleet had
a decode again). A model nobody serves still gets its 404 at once.

A stream whose only decode dies after it began streaming waits for a decode too, within
`--migration-timeout-s`: the restarted one (same id, a new registration) continues it; none
within the bound ends it with one error event.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdplane.launch.ports import free_port_run
from pdplane.sim.testing import expected_text
from tests.integration.gateway.conftest import MODEL, Stack, wait_for
from tests.integration.gateway.migration_helpers import errors_of, migrations, text_of

_PDPLANE = str(Path(sys.executable).parent / "pdplane")


def _decode(registry: str, port: int, itl_ms: float = 2) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            _PDPLANE,
            "sim",
            "--role",
            "decode",
            "--port",
            str(port),
            "--instance-id",
            "decode-0",
            "--registry",
            registry,
            "--lease-ttl-ms",
            "2000",
            "--itl-ms",
            str(itl_ms),
            "--model",
            MODEL,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _decodes(stack: Stack) -> int:
    return int(stack.health(MODEL).json()["models"].get(MODEL, {}).get("decode", 0))


@pytest.mark.parametrize("embedded", [True, False], ids=["embedded", "remote"])
def test_decode_sigkilled_and_restarted_under_a_trickle_no_request_fails(
    stack_factory, embedded: bool
) -> None:  # type: ignore[no-untyped-def]
    # Streams take their first token from decode here: one whose first token came from
    # prefill and whose decode is then found dead is a take-over, which ends in an error event
    # when no other decode serves (continuing it is request migration's part).
    stack: Stack = stack_factory(embedded=embedded, queue_timeout_s=60, first_token="decode")
    stack.sims(["prefill"], itl_ms=2)
    port = free_port_run()
    proc = _decode(stack.registry, port)
    try:
        wait_for(lambda: stack.health().status_code == 200, 20, "1P1D serving")
        results: list[tuple[float, float, int, bool]] = []  # (sent, latency, status, streamed)
        stop = threading.Event()

        def one(i: int) -> None:
            stream = i % 2 == 1
            body = {"model": MODEL, "prompt": f"hello {i}", "max_tokens": 4, "stream": stream}
            sent = time.monotonic()
            try:
                r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=90)
                ok = r.status_code
                if stream and (b'"error"' in r.content or b"[DONE]" not in r.content):
                    ok = -1  # an error event or a cut stream
            except httpx.HTTPError:
                ok = -2
            results.append((sent, time.monotonic() - sent, ok, stream))

        def trickle() -> None:
            threads = []
            i = 0
            while not stop.is_set():
                t = threading.Thread(target=one, args=(i,))
                t.start()
                threads.append(t)
                i += 1
                time.sleep(0.1)
            for t in threads:
                t.join(100)

        sender = threading.Thread(target=trickle)
        sender.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
        killed = time.monotonic()
        wait_for(lambda: _decodes(stack) == 0, 10, "the dead decode's lease to expire")
        time.sleep(1.0)  # a while with no decode at all
        proc = _decode(stack.registry, port)
        wait_for(lambda: _decodes(stack) == 1, 20, "the restarted decode")
        restarted = time.monotonic()
        time.sleep(1.0)
        stop.set()
        sender.join(120)
        # A model nobody serves: 404 at once, not a wait.
        r = httpx.post(
            f"{stack.url}/v1/completions", json={"model": "nobody", "prompt": "x"}, timeout=5
        )
        assert r.status_code == 404
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)

    statuses = [status for _, _, status, _ in results]
    during = [(lat, status) for sent, lat, status, _ in results if killed <= sent < restarted]
    assert len(during) >= 10, f"too few requests during the outage: {len(during)}"
    bad = [r for r in results if r[2] != 200]
    assert not bad, f"{len(bad)} of {len(results)} requests failed: {bad[:5]}"
    assert statuses.count(200) == len(results)
    # The ones sent while no decode served waited for it (not answered at once).
    assert max(lat for lat, _ in during) >= 1.0


PROMPT = "The only decode dies while it streams"


class _Reader(threading.Thread):
    """One stream of `body` read on a thread: `events` (parsed, `[DONE]` left out) as they
    come, `done` whether it ended whole (`[DONE]`, no error event); `started` is set once
    `after` events came."""

    def __init__(self, url: str, body: dict[str, Any], after: int) -> None:
        super().__init__()
        self.url, self.body, self.after = url, body, after
        self.events: list[dict[str, Any]] = []
        self.done = False
        self.started = threading.Event()

    def run(self) -> None:
        with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    # Whole only without an error event (one is followed by [DONE] too).
                    self.done = not any("error" in e for e in self.events)
                elif line.startswith("data: "):
                    self.events.append(json.loads(line[6:]))
                    if len(self.events) >= self.after:
                        self.started.set()
        self.started.set()


def _only_decode_killed_mid_stream(
    stack: Stack, max_tokens: int
) -> tuple[_Reader, subprocess.Popen[bytes], int]:
    """1P1D (the decode a `pdplane sim` process, 20 ms a token); a stream of `max_tokens`
    whose decode is SIGKILLed once the client has its first 4 tokens, then the decode's lease
    left to expire (no decode at all). Returns (the stream's reader, the dead process, its
    port)."""
    stack.sims(["prefill"], itl_ms=2)
    port = free_port_run()
    proc = _decode(stack.registry, port, itl_ms=20)
    wait_for(lambda: stack.health().status_code == 200, 20, "1P1D serving")
    options = {"stream_options": {"include_usage": True}}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True, **options}
    reader = _Reader(stack.url, body, after=4)
    reader.start()
    assert reader.started.wait(30), "the stream never began"
    proc.send_signal(signal.SIGKILL)
    proc.wait(5)
    assert not reader.done, "the stream ended before its decode was killed"
    wait_for(lambda: _decodes(stack) == 0, 10, "the dead decode's lease to expire")
    return reader, proc, port


@pytest.mark.parametrize("embedded", [False, True], ids=["remote", "embedded"])
def test_a_stream_whose_only_decode_dies_continues_on_it_restarted(
    stack_factory: Callable[..., Stack], embedded: bool
) -> None:
    # The first token comes from prefill; decode streams from the second on and dies.
    stack = stack_factory(
        embedded=embedded, first_token="prefill", migration_timeout_s=60, queue_timeout_s=60
    )
    reader, proc, port = _only_decode_killed_mid_stream(stack, max_tokens=60)
    try:
        assert reader.is_alive(), "the stream ended while no decode served"
        proc = _decode(stack.registry, port, itl_ms=20)  # same id and port: a restart
        reader.join(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)
    assert reader.done and not errors_of(reader.events), reader.events
    assert text_of(reader.events) == expected_text(PROMPT, 0, 60)
    usage = reader.events[-1]["usage"]
    assert usage["completion_tokens"] == 60, usage
    assert migrations(stack, "lost") + migrations(stack, "deregistered") == 1


def test_a_stream_whose_only_decode_stays_dead_ends_with_one_error_at_the_timeout(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(first_token="prefill", migration_timeout_s=3, queue_timeout_s=60)
    reader, _, _ = _only_decode_killed_mid_stream(stack, max_tokens=60)
    reader.join(30)
    assert not reader.is_alive() and not reader.done
    errors = errors_of(reader.events)
    assert len(errors) == 1 and "error" in reader.events[-1], reader.events
    assert (
        "not continued on another decode within --migration-timeout-s 3" in errors[0]["message"]
    ), errors
    assert errors[0]["code"] == 504
    sent = text_of(reader.events[:-1])
    assert len(sent.split()) >= 4 and expected_text(PROMPT, 0, 60).startswith(sent)
    wait_for(lambda: stack.scheduler_inflight() == 0, what="in-flight count back to 0")


def _running(port: int) -> float:
    """`vllm:num_requests_running` of the sim on `port` (0 when it does not answer)."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.split()[-1])
    return 0.0


def test_a_non_streamed_request_whose_only_decode_dies_is_answered_by_it_restarted(
    stack_factory: Callable[..., Stack],
) -> None:
    # Bounded by --migration-timeout-s, not --queue-timeout-s (shorter than the outage here).
    stack = stack_factory(migration_timeout_s=60, queue_timeout_s=0.5)
    stack.sims(["prefill"], itl_ms=2)
    port = free_port_run()
    proc = _decode(stack.registry, port, itl_ms=20)
    try:
        wait_for(lambda: stack.health().status_code == 200, 20, "1P1D serving")
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 60}
        got: list[httpx.Response] = []
        sender = threading.Thread(
            target=lambda: got.append(
                httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60)
            )
        )
        sender.start()
        wait_for(lambda: _running(port) >= 1, 20, "decode computing the answer")
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
        wait_for(lambda: _decodes(stack) == 0, 10, "the dead decode's lease to expire")
        assert sender.is_alive(), got  # waiting for a decode, not answered
        proc = _decode(stack.registry, port, itl_ms=20)  # same id and port: a restart
        sender.join(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)
    (r,) = got
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected_text(PROMPT, 0, 60)
    assert r.json()["usage"]["completion_tokens"] == 60
    assert migrations(stack, "lost") == 1
