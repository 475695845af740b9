"""The calibration workload: cells of B concurrent streamed requests, L-token prompts, O outputs.

Prompts are token-id lists (no tokenizer differences between vLLM and the simulator), unique
per request (no prefix-cache hits) unless a cell asks for a shared prefix. Every request sets
`ignore_eos` (vLLM stops only at `max_tokens`; the simulator ignores the field). TTFT = first
token event - send; ITL = time between consecutive token events of one request (events that
arrive in one read share its arrival time).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

__all__ = ["ERROR_CHARS", "Cell", "CellResult", "error_message", "measure_cells", "mixed_arrivals"]

#: most characters of an instance's error message kept per cell
ERROR_CHARS = 160


@dataclass(frozen=True, slots=True)
class Cell:
    """B requests of L prompt tokens and O output tokens, sent at once (or at `arrivals`)."""

    batch: int
    prompt: int
    output: int
    #: tokens of the prompt shared with a request sent just before the cell (prefix cache)
    shared_prefix: int = 0
    #: send offsets (s) per request; empty = all at once
    arrivals: tuple[float, ...] = ()

    @property
    def name(self) -> str:
        base = f"B{self.batch}-L{self.prompt}-O{self.output}"
        if self.shared_prefix:
            base += f"-P{self.shared_prefix}"
        return base + ("-poisson" if self.arrivals else "")


@dataclass(slots=True)
class CellResult:
    cell: Cell
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    errors: int = 0
    #: the first failed request's reason ("HTTP 404: <the instance's message>", bounded)
    first_error: str = ""

    def fail(self, reason: str) -> None:
        """Counts a failed request; keeps the first reason (at most `ERROR_CHARS` characters)."""
        self.errors += 1
        if not self.first_error:
            self.first_error = _bounded(reason)

    @property
    def ttft(self) -> float:
        return statistics.median(self.ttft_s) if self.ttft_s else float("nan")

    @property
    def itl(self) -> float:
        """Mean ITL (s): the simulator's timers fire on whole milliseconds, so single gaps are
        quantised while their mean stays exact (its steps are paced by deadlines)."""
        return statistics.fmean(self.itl_s) if self.itl_s else float("nan")

    @property
    def itl_median(self) -> float:
        return statistics.median(self.itl_s) if self.itl_s else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {
            "cell": asdict(self.cell),
            "name": self.cell.name,
            "ttft_median_s": self.ttft,
            "itl_mean_s": self.itl,
            "itl_median_s": self.itl_median,
            "requests": len(self.ttft_s),
            "errors": self.errors,
            "first_error": self.first_error,
            "ttft_s": self.ttft_s,
            "itl_s": self.itl_s,
        }


def mixed_arrivals(count: int, rate: float, seed: int) -> tuple[float, ...]:
    """Poisson arrival offsets (s) of `count` requests at `rate` per second."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(t)
    return tuple(out)


def _bounded(text: str) -> str:
    """`text` on one line, cut to `ERROR_CHARS` characters."""
    text = " ".join(text.split())
    return text[: ERROR_CHARS - 3] + "..." if len(text) > ERROR_CHARS else text


def error_message(status: int, body: bytes) -> str:
    """ "HTTP <status>: <message>" of an error answer: the OpenAI shape's `error.message` (vLLM,
    the simulator), an older flat `message` or FastAPI's `detail`, else the body; one line of
    at most `ERROR_CHARS` characters."""
    text = body.decode(errors="replace")
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        inner = data.get("error")
        for candidate in (
            inner.get("message") if isinstance(inner, dict) else inner,
            data.get("message"),
            data.get("detail"),
        ):
            if isinstance(candidate, str) and candidate:
                text = candidate
                break
    return _bounded(f"HTTP {status}: {text}" if text.strip() else f"HTTP {status}")


async def _one(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], result: CellResult
) -> None:
    t0 = time.perf_counter()
    times: list[float] = []
    try:
        async with session.post(url, json=body) as r:
            if r.status != 200:
                # Bounded read: the message is all that is kept.
                result.fail(error_message(r.status, await r.content.read(8192)))
                return
            buf = b""
            async for chunk in r.content.iter_any():
                now = time.perf_counter()
                buf += chunk
                *events, buf = buf.split(b"\n\n")
                for ev in events:
                    if not ev.startswith(b"data: {"):
                        continue
                    choices = json.loads(ev[6:]).get("choices") or []
                    if not choices:
                        continue
                    # vLLM sends token ids when asked (return_token_ids); text may be empty for
                    # a token that does not decode on its own.
                    ids = choices[0].get("token_ids") or []
                    count = len(ids) or (1 if choices[0].get("text") else 0)
                    times.extend([now] * count)
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.fail(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        return
    if not times:
        result.fail("the stream carried no tokens")
        return
    result.ttft_s.append(times[0] - t0)
    result.itl_s.extend(b - a for a, b in itertools.pairwise(times))


def _prompt(rng: random.Random, length: int, vocab: int, prefix: list[int]) -> list[int]:
    return prefix[:length] + [rng.randrange(10, vocab) for _ in range(length - len(prefix))]


async def _cell(
    session: aiohttp.ClientSession, url: str, model: str, cell: Cell, rng: random.Random, vocab: int
) -> CellResult:
    result = CellResult(cell)
    prefix: list[int] = []
    if cell.shared_prefix:
        prefix = _prompt(rng, cell.shared_prefix, vocab, [])
        warm = {"model": model, "prompt": [*prefix, 11], "max_tokens": 1, "ignore_eos": True}
        async with session.post(url, json=warm) as r:
            await r.read()

    def body() -> dict[str, Any]:
        return {
            "model": model,
            "prompt": _prompt(rng, cell.prompt, vocab, prefix),
            "max_tokens": cell.output,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0.0,
            "return_token_ids": True,
        }

    bodies = [body() for _ in range(cell.batch)]
    if not cell.arrivals:
        await asyncio.gather(*(_one(session, url, b, result) for b in bodies))
        return result
    start = time.perf_counter()
    tasks = []
    for offset, b in zip(cell.arrivals, bodies, strict=True):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_one(session, url, b, result)))
    await asyncio.gather(*tasks)
    return result


async def measure_cells(
    base_url: str,
    model: str,
    cells: list[Cell],
    *,
    repeats: int = 3,
    vocab: int = 900,
    seed: int = 0,
    pause_s: float = 0.2,
) -> list[CellResult]:
    """Runs each cell `repeats` times (merged), after one warm-up request. Returns per cell."""
    rng = random.Random(seed)
    url = base_url + "/v1/completions"
    timeout = aiohttp.ClientTimeout(total=600)
    out: list[CellResult] = []
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # Warm-up: every cell once, unmeasured (first shapes cost kernel set-up on CPU).
        for cell in cells:
            await _cell(session, url, model, cell, rng, vocab)
        for cell in cells:
            merged = CellResult(cell)
            for _ in range(repeats):
                r = await _cell(session, url, model, cell, rng, vocab)
                merged.ttft_s += r.ttft_s
                merged.itl_s += r.itl_s
                merged.errors += r.errors
                merged.first_error = merged.first_error or r.first_error
                await asyncio.sleep(pause_s)  # let the engine go idle between runs
            out.append(merged)
    return out
