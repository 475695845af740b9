"""The two upstream bodies of a disaggregated request: the prefill leg and the decode leg.

Prefill computes the prompt's KV cache and keeps it for decode, so its body is the client's
with one output token and nothing that would make vLLM reject that: `max_tokens=1` (and
`max_completion_tokens=1` on chat, the only endpoint whose model has it), `stream=false`, no
`stream_options` (vLLM refuses them without `stream`), `n=1`, no `min_tokens` (vLLM refuses
`min_tokens > max_tokens`). Decode gets the client's ORIGINAL body plus the
`kv_transfer_params` prefill returned, as returned.
"""

from __future__ import annotations

import json
from typing import Any

from pdplane.core.kv_params import PrefillRequestParams
from pdplane.gateway.validation import CHAT, Endpoint

__all__ = ["decode_body", "decode_body_parts", "prefill_body"]

_DROPPED_ON_PREFILL = ("stream_options", "min_tokens")


def prefill_body(endpoint: Endpoint, body: dict[str, Any], request_id: str) -> bytes:
    """JSON bytes of the prefill leg for the client `body` (not modified)."""
    out = dict(body)
    for key in _DROPPED_ON_PREFILL:
        out.pop(key, None)
    out["max_tokens"] = 1
    if endpoint == CHAT:
        out["max_completion_tokens"] = 1
    else:
        # Completions has no such field; vLLM would only warn, but keep the body clean.
        out.pop("max_completion_tokens", None)
    out["stream"] = False
    out["n"] = 1
    out["kv_transfer_params"] = PrefillRequestParams(request_id).to_dict()
    return json.dumps(out, separators=(",", ":")).encode()


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> bytes:
    """JSON bytes of the decode leg: the client `body` plus prefill's `kv_transfer_params`."""
    out = dict(body)
    out["kv_transfer_params"] = kv_transfer_params
    return json.dumps(out, separators=(",", ":")).encode()


def decode_body_parts(body: dict[str, Any]) -> tuple[bytes, bytes]:
    """The decode leg split around prefill's answer, for concurrent dispatch.

    Returns (head, tail) such that `head + json(kv_transfer_params) + tail` is the decode body:
    head = the client's fields and `"kv_transfer_params":`, tail = the closing brace.
    """
    rest = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    fields = json.dumps(rest, separators=(",", ":")).encode()[:-1]
    sep = b"," if rest else b""
    return fields + sep + b'"kv_transfer_params":', b"}"
