"""What the request-migration tests share (test_migration*.py, test_no_decode_waits.py): a
fleet, streams read whole, and checks that a lost decode left nothing held."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx

from pdplane.cli import drain
from pdplane.sim.testing import RunningSims, SimHandle
from tests.integration.gateway.conftest import Stack, wait_for
from tests.integration.gateway.helpers import metric

#: The prompt the migration tests send.
MIGRATION_PROMPT = "A decode instance may die in the middle of a stream"


def stream_events(
    url: str,
    path: str,
    body: dict[str, Any],
    request_id: str = "",
    gaps: list[float] | None = None,
) -> tuple[list[dict[str, Any]], bool]:
    """(the parsed events, whether the stream ended whole: one [DONE] and no error event) of
    one stream; `gaps` gets its longest wait between two events (s)."""
    headers = {"X-Request-Id": request_id} if request_id else {}
    raw: list[bytes] = []
    gap = last = 0.0
    with httpx.stream("POST", f"{url}{path}", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line:
                now = time.perf_counter()
                gap, last = (max(gap, now - last) if last else 0.0), now
                raw.append(line.encode())
    if gaps is not None:
        gaps.append(gap)
    ended = raw[-1] == b"data: [DONE]"
    assert raw.count(b"data: [DONE]") == (1 if ended else 0), raw
    failed = any(e.startswith(b'data: {"error"') for e in raw)
    assert ended or not failed, raw  # an error event is followed by [DONE], as vLLM's are
    return [json.loads(e[6:]) for e in raw if e != b"data: [DONE]"], ended and not failed


def stream_in_background(
    url: str, path: str, body: dict[str, Any], request_id: str
) -> tuple[threading.Thread, list[tuple[list[dict[str, Any]], bool]]]:
    """`stream_events` on a thread, started: (the thread, a list that gets its result)."""
    out: list[tuple[list[dict[str, Any]], bool]] = []
    runner = threading.Thread(target=lambda: out.append(stream_events(url, path, body, request_id)))
    runner.start()
    return runner, out


def text_of(events: list[dict[str, Any]]) -> str:
    """The joined text of parsed events, completions or chat, every choice."""
    out = []
    for event in events:
        for choice in event.get("choices") or ():
            out.append(
                choice["delta"].get("content") or "" if "delta" in choice else choice["text"]
            )
    return "".join(out)


def errors_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The `error` objects among parsed events."""
    return [e["error"] for e in events if "error" in e]


def logprobs_of(events: list[dict[str, Any]]) -> list[Any]:
    """Per token, its logprobs entry as the client got it (chat: a `content` item;
    completions: the tuple of its lists' entries)."""
    out: list[Any] = []
    for event in events:
        for choice in event.get("choices") or ():
            lp = choice.get("logprobs")
            if lp is None:
                continue
            if "content" in lp:
                out += lp["content"]
            else:
                keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
                out += list(zip(*(lp[k] for k in keys), strict=True))
    return out


def fleet(stack: Stack, decodes: int, **knobs: Any) -> tuple[RunningSims, RunningSims]:
    """One prefill and `decodes` decodes (sims with `knobs`), ready: (prefill, decodes)."""
    prefill = stack.sims(["prefill"], **knobs)
    decode = stack.sims(["decode"] * decodes, **knobs)
    stack.wait_ready(prefill)
    stack.wait_ready(decode)
    return prefill, decode


def used_blocks(sim: SimHandle) -> int:
    """KV blocks `sim` holds now."""
    pool = sim.instance.state.core.pool
    return pool.num_blocks - pool.num_free


def was_killed(sim: SimHandle) -> bool:
    """Whether `sim` was killed (by its `kill_after_tokens` fault)."""
    return sim.instance._killing is not None


def migrations(stack: Stack, reason: str) -> float:
    """The gateway's migrations counter for `reason`."""
    return metric(stack, f'pdplane_gateway_migrations_total{{reason="{reason}"}}')


def nothing_held(stack: Stack, sims: list[SimHandle]) -> None:
    """Waits until no sim holds KV (prefill transfers, blocks), nothing is in flight in the
    scheduler and no AbortTransfer is still running; fails on timeout."""
    for sim in sims:
        if sim.role == "prefill":
            wait_for(lambda s=sim: s.held_transfers() == [], what="prefill's KV freed")
        wait_for(lambda s=sim: used_blocks(s) == 0, what=f"{sim.instance_id}'s KV blocks free")
    wait_for(lambda: stack.scheduler_inflight() == 0, what="in-flight count back to 0")
    wait_for(lambda: stack.background_tasks() == 0, what="no AbortTransfer still running")


def lose_the_decode_with_resumed_prefills_held(
    stack: Stack, prefill: SimHandle, decodes: RunningSims, request_id: str
) -> None:
    """Once the stream `request_id` has sent tokens from one of `decodes`, makes `prefill`
    finish its prefills for that request without answering them (their KV held), then drains
    that decode (with `--drain-grace-s 0`: its stream is moved at once, and its resumed legs'
    prefills hold their KV until the gateway frees it)."""

    def sent() -> bool:
        return any(r["tokens_sent"] >= 2 for d in decodes.handles for r in d.records())

    wait_for(sent, what="the stream's tokens from a decode")
    (victim,) = [d for d in decodes.handles if d.records()]
    assert victim.records()[0]["request_id"].startswith(request_id)
    prefill.set_faults(fail_request_prefix=request_id, fail_mode="stall")
    assert drain.main([victim.instance_id, "--registry", stack.registry]) == 0
