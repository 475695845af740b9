"""Reproducible mid-stream faults: one chosen stream cut at token N, and a whole instance killed
at token N as a SIGKILL would (every stream cut, no deregistration: the lease lapses)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from pdplane.registry.client import InstanceWatcher
from pdplane.sim.testing import running_sims
from tests.integration.registry.fixtures import running_registry

BODY = {"model": "sim-model", "prompt": "a b c", "max_tokens": 40, "stream": True}


def _tokens(url: str, request_id: str, out: dict[str, Any]) -> None:
    """Streams one completion; `out[request_id]` = (tokens received, ended with [DONE])."""
    got, done = 0, False
    try:
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            json=BODY,
            headers={"X-Request-Id": request_id},
            timeout=10,
        ) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    got += len(json.loads(line[6:])["choices"])
    except httpx.HTTPError:
        pass  # the connection was cut
    out[request_id] = (got, done)


def test_only_the_chosen_request_is_cut_at_its_token() -> None:
    with running_sims(["decode"], itl_ms=5) as sims:
        sims[0].set_faults(fail_request_prefix="victim-", fail_mode="drop", fail_after_tokens=7)
        out: dict[str, Any] = {}
        threads = [
            threading.Thread(target=_tokens, args=(sims[0].url, rid, out))
            for rid in ("victim-1", "other-1", "other-2")
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    assert out == {"victim-1": (7, False), "other-1": (40, True), "other-2": (40, True)}


def test_a_killed_instance_cuts_every_stream_and_its_lease_lapses() -> None:
    with running_registry(lease_ttl_ms=1000, heartbeat_interval_ms=200) as registry:
        seen: list[dict[str, Any]] = []
        watcher = InstanceWatcher(registry, on_change=lambda view: seen.append(dict(view)))
        watcher.start()
        try:
            with running_sims(["decode"], registry=registry, itl_ms=20) as sims:
                sim = sims[0]
                assert watcher.wait_ready(5)
                deadline = time.monotonic() + 5
                while sim.instance_id not in watcher.snapshot() and time.monotonic() < deadline:
                    time.sleep(0.02)
                sim.set_faults(kill_after_tokens=10)
                out: dict[str, Any] = {}
                threads = [
                    threading.Thread(target=_tokens, args=(sim.url, rid, out)) for rid in ("a", "b")
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(20)
                killed = time.monotonic()
                # Both streams were cut, neither finished; nothing answers any more.
                assert all(not done and got < 40 for got, done in out.values()), out
                assert max(got for got, _ in out.values()) >= 10, out
                with pytest.raises(httpx.HTTPError):
                    httpx.get(f"{sim.url}/health", timeout=2)
                # Not deregistered: listed until its lease lapses (1 s TTL), then removed.
                assert sim.instance_id in watcher.snapshot()
                while sim.instance_id in watcher.snapshot():
                    assert time.monotonic() - killed < 5, "the lease never lapsed"
                    time.sleep(0.02)
                assert time.monotonic() - killed > 0.5  # removed by expiry, not at once
        finally:
            watcher.stop()
