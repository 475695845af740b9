"""Gateway CPU per request for exact prompt ids (tokenizer + prefix hashes) vs the estimate.

Per prompt shape and length: the gateway's request step with `--tokenizer` (parse_request +
`pdplane.gateway.prompt_ids.exact_prompt`: tokenize, hash at block sizes 16 and 128) against
the same request without it (parse_request, estimated length), median CPU microseconds per
request over `--repeats` rounds, and the ratio. Then the event loop's longest stall while one
long prompt is handled by `exact_prompt_async` (worker thread) vs inline.

    python bench/relay/prompt_ids.py                 # tiny model's tokenizer (built locally)
    python bench/relay/prompt_ids.py --tokenizer DIR # a real model's tokenizer folder
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from pdplane.gateway.prompt_ids import PromptTokenizer, exact_prompt, exact_prompt_async
from pdplane.gateway.validation import CHAT, COMPLETIONS, Endpoint, parse_request
from pdplane.launch.deployment import default_model_cache
from pdplane.models.tiny import build_tiny_model

_WORDS = [
    "the",
    "prefill",
    "instance",
    "holds",
    "a",
    "cache",
    "block",
    "for",
    "decode",
    "to",
    "pull",
    "over",
    "the",
    "stream",
]
_BLOCK_SIZES = (16, 128)


def _text(chars: int) -> str:
    out: list[str] = []
    n = 0
    i = 0
    while n < chars:
        w = _WORDS[i % len(_WORDS)]
        out.append(w)
        n += len(w) + 1
        i += 1
    return " ".join(out)[:chars]


def _body(kind: str, chars: int) -> tuple[Endpoint, bytes]:
    text = _text(chars)
    if kind == "chat":
        body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": text}]}
        return CHAT, json.dumps(body).encode()
    return COMPLETIONS, json.dumps({"model": "m", "prompt": text}).encode()


def _cpu_us(fn: Any, n: int) -> float:
    start = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - start) / n * 1e6


async def _max_stall_ms(work: Any) -> float:
    stalls: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            stalls.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    await work()
    done.set()
    await task
    return max(stalls) * 1e3


def _row(tok: PromptTokenizer, kind: str, chars: int, repeats: int) -> tuple[int, float, float]:
    """(tokens, estimate us/req, exact us/req) for one prompt shape and length."""
    endpoint, raw = _body(kind, chars)
    n = max(5, 200_000 // chars)
    tokens = exact_prompt(tok, parse_request(endpoint, raw), 1 << 20, _BLOCK_SIZES).prompt_tokens

    def estimate() -> None:
        parse_request(endpoint, raw)

    def exact() -> None:
        exact_prompt(tok, parse_request(endpoint, raw), 1 << 20, _BLOCK_SIZES)

    est = [_cpu_us(estimate, n) for _ in range(repeats)]
    ex = [_cpu_us(exact, n) for _ in range(repeats)]
    return tokens, statistics.median(est), statistics.median(ex)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    path = args.tokenizer or build_tiny_model(default_model_cache())
    tok = PromptTokenizer(path)
    print(f"tokenizer: {path}  (block sizes {_BLOCK_SIZES})\n")
    print("| prompt | chars | tokens | estimate us/req | exact us/req | exact / estimate |")
    print("|---|---|---|---|---|---|")
    for kind in ("completions", "chat"):
        for chars in (1_000, 8_000, 32_000, 128_000):
            tokens, e, x = _row(tok, kind, chars, args.repeats)
            print(f"| {kind} | {chars} | {tokens} | {e:.0f} | {x:.0f} | {x / e:.1f}x |")
    endpoint, raw = _body("completions", 128_000)
    req = parse_request(endpoint, raw)

    async def inline() -> None:
        exact_prompt(tok, req, 1 << 20, _BLOCK_SIZES)

    async def offloaded() -> None:
        await exact_prompt_async(tok, req, 1 << 20, _BLOCK_SIZES)

    stall_inline = statistics.median(asyncio.run(_max_stall_ms(inline)) for _ in range(3))
    stall_thread = statistics.median(asyncio.run(_max_stall_ms(offloaded)) for _ in range(3))
    print(
        f"\nevent-loop max stall during one 128k-char prompt: inline {stall_inline:.1f} ms, "
        f"worker thread {stall_thread:.1f} ms ({stall_inline / stall_thread:.1f}x less)"
    )


if __name__ == "__main__":
    main()
