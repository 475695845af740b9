"""The two upstream bodies of a disaggregated request: the prefill leg and the decode leg.

Prefill computes the prompt's KV cache and keeps it for decode, so its body is the client's
with one output token and nothing that would make vLLM reject that: `max_tokens=1` (and
`max_completion_tokens=1` on chat, the only endpoint whose model has it), `stream=false`, no
`stream_options` (vLLM refuses them without `stream`), `n=1`, no `min_tokens` (vLLM refuses
`min_tokens > max_tokens`). Decode gets the client's ORIGINAL body plus the
`kv_transfer_params` prefill returned, as returned (spliced into the client's own bytes).
"""

from __future__ import annotations

import json
from typing import Any

from pdplane.core.kv_params import PrefillRequestParams
from pdplane.gateway.validation import CHAT, Endpoint

__all__ = ["decode_body", "decode_body_parts", "prefill_body"]

_DROPPED_ON_PREFILL = ("stream_options", "min_tokens")


def prefill_body(
    endpoint: Endpoint,
    body: dict[str, Any],
    request_id: str,
    decode_id: str = "",
    decode_kv_endpoint: str = "",
    *,
    token_ids: bool = False,
) -> bytes:
    """JSON bytes of the prefill leg for the client `body` (not modified). `decode_id` and
    `decode_kv_endpoint` name the scheduled decode (a push-mode prefill sends the KV there).
    `token_ids` asks prefill for its prompt and output token ids (`return_token_ids`), which
    the first token from prefill needs (`pdplane.gateway.first_token`).

    With `n` > 1 the decode is not named: vLLM fans such a request out into several engine
    requests on decode, and a pushed transfer serves only the first of them, while pulls serve
    them all."""
    if isinstance(body.get("n"), int) and body["n"] > 1:
        decode_id = decode_kv_endpoint = ""
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
    if token_ids:
        out["return_token_ids"] = True
    out["kv_transfer_params"] = PrefillRequestParams(
        request_id, decode_id or None, decode_kv_endpoint or None
    ).to_dict()
    return json.dumps(out, separators=(",", ":")).encode()


def decode_body(raw: bytes, body: dict[str, Any], kv_transfer_params: bytes) -> bytes:
    """Bytes of the decode leg: the client's body plus prefill's `kv_transfer_params` (JSON).

    `raw` is the client's body as received and `body` its parsed form.
    """
    head, tail = decode_body_parts(raw, body)
    return head + kv_transfer_params + tail


def decode_body_parts(raw: bytes, body: dict[str, Any]) -> tuple[bytes, bytes]:
    """The decode leg split around prefill's answer (concurrent dispatch sends `head` early).

    Returns (head, tail) such that `head + json(kv_transfer_params) + tail` is the decode body.
    The client's bytes are reused as they are (no re-encoding of a possibly long prompt): the
    closing brace of `raw` becomes `,"kv_transfer_params":` + ... + `}`. A body that already
    holds `kv_transfer_params` (it would then appear twice), or that is not plain UTF-8 JSON
    text starting with `{`, is re-encoded without that key instead.
    """
    text = raw.strip()
    if text[:1] == b"{" and text[-1:] == b"}" and "kv_transfer_params" not in body and body:
        return text[:-1] + b',"kv_transfer_params":', b"}"
    rest = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    fields = json.dumps(rest, separators=(",", ":")).encode()[:-1]
    sep = b"," if rest else b""
    return fields + sep + b'"kv_transfer_params":', b"}"
