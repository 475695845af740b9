"""Open-loop replay of a `bench.routing.workloads.Workload` against an OpenAI endpoint.

Every first turn is sent at its time (modelled seconds / `time_scale` of wall time), whether
or not earlier requests finished; a session's follow-ups go `after_s` (think time) after the
previous turn finished, with the conversation so far (the answers as they were streamed).
Requests are streamed chat completions with `stream_options.include_usage`. Per request:
TTFT (first content token), end, completion tokens (from usage), status. Times are converted
to modelled seconds (x `time_scale`), so they compare with the sims' own numbers.

`client_numbers` summarises a window of the outcomes: TTFT percentiles of the requests sent in
it (a request that failed, or was still waiting for its first token at the end, counts as an
infinite TTFT), mean TPOT per request, goodput (requests per second meeting both SLOs).
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.routing.workloads import Turn, Workload
from tests.support.stats import percentile

__all__ = ["Outcome", "client_numbers", "closed_loop", "replay"]


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it (modelled seconds; -1 = not reached)."""

    sent: float
    ttft: float = -1.0
    end: float = -1.0
    tokens: int = 0
    status: int = 0
    error: str = ""
    session: str = ""
    turn: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.ttft >= 0

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (s); 0 for one-token answers."""
        return (self.end - self.sent - self.ttft) / (self.tokens - 1) if self.tokens > 1 else 0.0


@dataclass
class _Run:
    url: str
    model: str
    scale: float
    session: aiohttp.ClientSession
    t0: float
    outcomes: list[Outcome] = field(default_factory=list)
    history: dict[str, list[dict[str, str]]] = field(default_factory=dict)

    def now(self) -> float:
        return (time.perf_counter() - self.t0) * self.scale


def _content(event: bytes) -> str | None:
    try:
        obj = json.loads(event[6:])
    except ValueError:
        return None
    choices = obj.get("choices") or []
    if not choices:
        return None
    delta = choices[0].get("delta") or {}
    return delta.get("content") or choices[0].get("text") or None


async def _send(run: _Run, turn: Turn, out: Outcome, keep_text: bool) -> str:
    """Sends `turn`, filling `out` as the answer streams (cancellable at any point)."""
    messages = run.history.get(turn.session, []) + turn.messages if turn.turn else turn.messages
    body: dict[str, Any] = {
        "model": run.model,
        "messages": messages,
        "max_tokens": turn.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if turn.user:
        body["user"] = turn.user
    text: list[str] = []
    try:
        async with run.session.post(run.url, json=body) as r:
            out.status = r.status
            if r.status != 200:
                out.error = (await r.read())[:200].decode(errors="replace")
                return ""
            buf = b""
            async for chunk in r.content.iter_any():
                buf += chunk
                *events, buf = buf.split(b"\n\n")
                for ev in events:
                    if not ev.startswith(b"data: {"):
                        continue
                    if out.ttft < 0 or keep_text:
                        piece = _content(ev)
                        if piece and out.ttft < 0:
                            out.ttft = run.now() - out.sent
                        if piece and keep_text:
                            text.append(piece)
                    if b'"usage":{' in ev and b'"choices":[]' in ev:
                        out.tokens = json.loads(ev[6:])["usage"]["completion_tokens"]
                    elif b'"error"' in ev[:20]:
                        out.error = ev[:200].decode(errors="replace")
            out.end = run.now()
            if out.error == "unfinished":
                out.error = ""
    except (aiohttp.ClientError, TimeoutError) as exc:
        out.error = repr(exc)[:200]
    return "".join(text)


async def _session(run: _Run, first: Turn, follow: list[Turn]) -> None:
    delay = first.at / run.scale - (time.perf_counter() - run.t0)
    if delay > 0:
        await asyncio.sleep(delay)
    turn = first
    rest = list(follow)
    while True:
        out = Outcome(run.now(), session=turn.session, turn=turn.turn, error="unfinished")
        run.outcomes.append(out)
        text = await _send(run, turn, out, keep_text=bool(rest))
        if not rest or not out.ok:
            return
        history = run.history.setdefault(turn.session, [])
        history.extend(turn.messages)
        history.append({"role": "assistant", "content": text})
        turn = rest.pop(0)
        await asyncio.sleep(turn.at / run.scale)


async def replay(
    url: str,
    workload: Workload,
    *,
    model: str = "sim-model",
    time_scale: float = 1.0,
    stop_at_s: float = 0.0,
) -> list[Outcome]:
    """Replays `workload` at `url` (…/v1/chat/completions); returns every request's outcome.

    With `stop_at_s` (modelled seconds from the start) requests still open then are
    cancelled and reported with error "unfinished" (a backlog past saturation would otherwise
    take arbitrarily long to drain); turns not yet sent are not sent.
    """
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        run = _Run(url, model, time_scale, session, time.perf_counter())
        firsts = workload.first_turns
        follow: dict[str, list[Turn]] = {}
        for t in sorted(workload.turns, key=lambda t: t.turn):
            if t.turn:
                follow.setdefault(t.session, []).append(t)
        tasks = [asyncio.create_task(_session(run, t, follow.get(t.session, []))) for t in firsts]
        if stop_at_s:
            _, pending = await asyncio.wait(tasks, timeout=stop_at_s / time_scale)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        else:
            await asyncio.gather(*tasks)
        return run.outcomes


async def closed_loop(
    url: str,
    *,
    concurrency: int,
    duration_s: float,
    prompt_tokens: int,
    max_tokens: int,
    model: str = "sim-model",
    time_scale: float = 1.0,
    seed: int = 0,
) -> list[Outcome]:
    """`concurrency` clients sending back to back (no think time) for `duration_s` modelled
    seconds, unique prompts of `prompt_tokens` words; outcomes of the requests that finished
    (or failed) before the end."""
    import random

    from bench.routing.workloads import Lengths, poisson

    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        run = _Run(url, model, time_scale, session, time.perf_counter())

        async def client() -> None:
            while run.now() < duration_s:
                turn = poisson(
                    1.0, 1, Lengths(prompt_tokens), Lengths(max_tokens), seed=rng.randrange(1 << 30)
                ).turns[0]
                out = Outcome(run.now(), error="unfinished")
                await _send(run, turn, out, keep_text=False)
                if run.now() <= duration_s:
                    run.outcomes.append(out)

        await asyncio.gather(*(client() for _ in range(concurrency)))
        return run.outcomes


def client_numbers(
    outcomes: Sequence[Outcome], start: float, end: float, slo_ttft_s: float, slo_tpot_s: float
) -> dict[str, Any]:
    """Latencies of the requests sent in [start, end) (modelled s) and goodput."""
    window = [o for o in outcomes if start <= o.sent < end]
    # A request cut off after its first token still has a TTFT; one that failed or never got
    # a token counts as infinite.
    ttfts = [
        o.ttft if o.ttft >= 0 and not (o.error and o.error != "unfinished") else math.inf
        for o in window
    ]
    tpots = [o.tpot for o in window if o.ok and o.tokens > 1]
    good = [o for o in window if o.ok and o.ttft <= slo_ttft_s and o.tpot <= slo_tpot_s]
    span = max(end - start, 1e-9)
    return {
        "requests": len(window),
        "ok": sum(1 for o in window if o.ok),
        "unfinished": sum(1 for o in window if o.error == "unfinished"),
        "errors": sum(1 for o in window if not o.ok and o.error != "unfinished"),
        "first_error": next((o.error for o in window if o.error and o.error != "unfinished"), ""),
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3,
        "ttft_p90_ms": percentile(ttfts, 90) * 1e3,
        "ttft_p99_ms": percentile(ttfts, 99) * 1e3,
        "tpot_mean_ms": statistics.fmean(tpots) * 1e3 if tpots else float("nan"),
        "tpot_p99_ms": percentile(tpots, 99) * 1e3,
        "goodput_rps": len(good) / span,
        "offered_rps": len(window) / span,
    }
