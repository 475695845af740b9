"""The fleet's prefix cache hit in `usage.prompt_tokens_details.cached_tokens`, as
`vllm serve --enable-prompt-tokens-details` reports one instance's.

On a prefill/decode pair the prompt is computed by prefill, so the prompt tokens nobody
computed are prefill's prefix cache hit. vLLM (0.32) returns it with the prefill leg's
`kv_transfer_params` as `remote_prefill_cached_tokens` (the number a decode told it reports in
place of its own hit, which is the whole prompt, loaded). With the gateway's
`--enable-prompt-tokens-details` that number is written into every usage block the client gets:
a non-streamed answer's, and a stream's usage chunks (which the client asks for with
`stream_options.include_usage`, as from vLLM). An attempt without a prefill leg (decode computes
the prompt itself) keeps decode's own details when decode reports them (a decode started with
the vLLM flag); else it gets the scheduler's count of the prompt tokens decode's KV cache held
(`decode_cached_tokens`, whole blocks, from decode's own KV cache events: the hit that let
decode prefill alone), counted as vLLM counts a hit (`decode_hit`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from pdplane.gateway.replies import sse_event

__all__ = ["cached_tokens_of", "decode_hit", "rewrite_events", "rewrite_json", "with_cached_tokens"]

_USAGE = b'"usage":{'


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def cached_tokens_of(prefill_answer: Mapping[str, Any]) -> int | None:
    """Prefill's prefix cache hit (tokens) from its parsed answer: its `kv_transfer_params`'
    `remote_prefill_cached_tokens` (vLLM 0.32), else its own usage's
    `prompt_tokens_details.cached_tokens` (a prefill started with
    `--enable-prompt-tokens-details`); None when it reports neither."""
    kv = prefill_answer.get("kv_transfer_params")
    hit = _count(kv.get("remote_prefill_cached_tokens")) if isinstance(kv, Mapping) else None
    if hit is not None:
        return hit
    usage = prefill_answer.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, Mapping) else None
    return _count(details.get("cached_tokens")) if isinstance(details, Mapping) else None


def decode_hit(held: int, prompt_tokens: int, block_sizes: Iterable[int]) -> int:
    """The prefix cache hit (tokens) vLLM reports for a prompt of `prompt_tokens` whose first
    `held` tokens (whole blocks) its KV cache holds: never the prompt's last token, which it
    computes in any case for its logits (vLLM v1 `KVCacheManager.get_computed_blocks` caps
    the hit at `prompt_tokens - 1`, whole blocks). `block_sizes`: the block sizes the prompt
    was hashed at (tokens); the held prefix is whole blocks of the largest that divides it."""
    if held < prompt_tokens:
        return held
    sizes = [bs for bs in block_sizes if bs > 0 and held % bs == 0]
    return (prompt_tokens - 1) // max(sizes) * max(sizes) if sizes else held


def with_cached_tokens(
    usage: Mapping[str, Any], cached: int, keep_reported: bool = False
) -> dict[str, Any]:
    """`usage` with `prompt_tokens_details.cached_tokens` = `cached` (other details kept);
    with `keep_reported`, a count the instance wrote itself is kept instead."""
    details = usage.get("prompt_tokens_details")
    reported = isinstance(details, Mapping) and _count(details.get("cached_tokens")) is not None
    if keep_reported and reported:
        return dict(usage)
    kept = dict(details) if isinstance(details, Mapping) else {}
    return {**usage, "prompt_tokens_details": {**kept, "cached_tokens": cached}}


def rewrite_json(body: bytes, cached: int | None, keep_reported: bool = False) -> bytes:
    """A non-streamed answer (JSON bytes) with `cached` in its usage (see
    `with_cached_tokens`); unchanged when `cached` is None or it has no usage object (an
    error, say)."""
    if cached is None:
        return body
    try:
        obj = json.loads(body)
    except ValueError:
        return body
    if not isinstance(obj, dict) or not isinstance(obj.get("usage"), dict):
        return body
    obj["usage"] = with_cached_tokens(obj["usage"], cached, keep_reported)
    # As vLLM's (Starlette's) JSONResponse writes it.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def rewrite_events(events: bytes, cached: int | None, keep_reported: bool = False) -> bytes:
    """Whole SSE events (`data: ...\\n\\n` each) with `cached` in every usage object (see
    `with_cached_tokens`); events without one (all, when `cached` is None) pass as they are
    (bytes unchanged)."""
    if cached is None or _USAGE not in events:
        return events
    out = []
    for event in events.split(b"\n\n")[:-1]:
        obj = None
        if _USAGE in event and event.startswith(b"data: {"):
            try:
                obj = json.loads(event[6:])
            except ValueError:
                obj = None
        if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
            obj["usage"] = with_cached_tokens(obj["usage"], cached, keep_reported)
            out.append(sse_event(obj))
        else:
            out.append(event + b"\n\n")
    return b"".join(out)
