"""Must show: no decode for a moment is not an error.

1P1D, the decode a `pdplane sim` process SIGKILLed under a steady trickle of requests and
started again a few seconds later (same instance id and port, as `pdplane up` restarts it):
every request answers 200; those that came while no decode served waited in the admission
queue (up to `--queue-timeout-s`) instead of getting 503 at once, and those that had already
been sent to the dead decode before its lease expired waited too (retried once the fleet had
a decode again). A model nobody serves still gets its 404 at once.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.gateway.conftest import MODEL, Stack, wait_for

_PDPLANE = str(Path(sys.executable).parent / "pdplane")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _decode(registry: str, port: int) -> subprocess.Popen[bytes]:
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
            "2",
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
    port = _free_port()
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
