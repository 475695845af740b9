"""Every upstream body of a disaggregated request, built in one place.

- The prefill leg: the client's body with one output token and nothing that would make vLLM
  reject that: `max_tokens=1` (and `max_completion_tokens=1` on chat, the only endpoint whose
  model has it), `stream=false`, no `stream_options` (vLLM refuses them without `stream`),
  `n=1`, no `min_tokens` (vLLM refuses `min_tokens > max_tokens`), plus
  `kv_transfer_params = PrefillRequestParams(...)`.
- The decode leg: the client's ORIGINAL body plus the `kv_transfer_params` prefill returned, as
  returned (spliced into the client's own bytes: a long prompt is not re-encoded).
- The decode leg after the first token from prefill (`continuation_body`): a `/v1/completions`
  body, prefill's prompt ids plus the first token, one token less to generate, the client's
  sampling fields. `takes_first_token` says which requests may take that path: those whose
  tokens 2..n decode samples exactly as one instance would.
- A stream resumed on another decode after its decode was lost (`resumed_body`): a
  `/v1/completions` body, the prompt ids plus the tokens already sent, what is left to
  generate, the client's sampling fields; `migratable` says which streams can be resumed, and
  `with_token_ids` asks a stream's decode for the token ids that resuming needs.
"""

from __future__ import annotations

import json
from typing import Any

from pdplane.core.kv_params import PrefillRequestParams
from pdplane.gateway.validation import CHAT, COMPLETIONS, ClientRequest, Endpoint

__all__ = [
    "continuation_body",
    "decode_body",
    "decode_body_parts",
    "migratable",
    "prefill_body",
    "requested_max",
    "resumed_body",
    "takes_first_token",
    "with_token_ids",
]

_DROPPED_ON_PREFILL = ("stream_options", "min_tokens")
#: Fields that decode receives as the client sent them (sampling of tokens 2..n).
_TO_DECODE = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "allowed_token_ids",
    "user",
    "priority",
    "stream_options",
)
#: Fields that must be absent, null or hold the neutral value given: with other values tokens
#: 2..n depend on token 1 other than through the prompt (a seed's generator, a stop string
#: across the two, penalties counting output tokens, min_tokens), or the client wants per-token
#: output (`logprobs: 0` on completions still returns the sampled tokens' logprobs).
_UNSET: dict[str, tuple[object, ...]] = {
    "stop": ("", []),
    "seed": (),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logprobs": (False,),
    "echo": (False,),
    "min_tokens": (0,),
}
#: Fields with which decode, continuing from the first token, samples exactly as one instance
#: would: those it receives, those prefill alone uses (the prompt's), and those whose values
#: `takes_first_token` checks. A request with any other field takes the usual path.
_COMMON = frozenset(_TO_DECODE) | {
    "model",
    "max_tokens",
    "stream",
    "add_special_tokens",
    "n",
    *_UNSET,
}
_FIELDS: dict[Endpoint, frozenset[str]] = {
    COMPLETIONS: _COMMON | {"prompt"},
    CHAT: _COMMON
    | {
        "messages",
        "max_completion_tokens",
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "top_logprobs",
    },
}
#: vLLM's `max_tokens` default for /v1/completions (chat has none: up to the model's length).
_COMPLETIONS_MAX_TOKENS = 16


def _json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def prefill_body(
    endpoint: Endpoint,
    body: dict[str, Any],
    request_id: str,
    decode_id: str = "",
    decode_kv_endpoint: str = "",
    *,
    token_ids: bool = False,
    transfer_id: str | None = None,
) -> bytes:
    """JSON bytes of the prefill leg for the client `body` (not modified). `decode_id` and
    `decode_kv_endpoint` name the scheduled decode (a push-mode prefill sends the KV there).
    `token_ids` asks prefill for its prompt and output token ids (`return_token_ids`), which
    the first token from prefill needs. `transfer_id`: the id prefill is to hold the KV under
    (`pdplane.core.kv_params.make_transfer_id`; None: prefill issues one).

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
        request_id, decode_id or None, decode_kv_endpoint or None, transfer_id
    ).to_dict()
    return _json(out)


def decode_body(raw: bytes, body: dict[str, Any], kv_transfer_params: bytes) -> bytes:
    """Bytes of the decode leg: the client's body plus prefill's `kv_transfer_params` (JSON).

    `raw` is the client's body as received and `body` its parsed form.
    """
    head, tail = decode_body_parts(raw, body)
    return head + kv_transfer_params + tail


def decode_body_parts(
    raw: bytes, body: dict[str, Any], token_ids: bool = False
) -> tuple[bytes, bytes]:
    """The decode leg split around prefill's answer (concurrent dispatch sends `head` early).

    Returns (head, tail) such that `head + json(kv_transfer_params) + tail` is the decode body.
    The client's bytes are reused as they are (no re-encoding of a possibly long prompt): the
    closing brace of `raw` becomes `,"kv_transfer_params":` + ... + `}`. A body that already
    holds `kv_transfer_params` (it would then appear twice), or that is not plain UTF-8 JSON
    text starting with `{`, is re-encoded without that key instead. `token_ids` asks decode
    for token ids too (`"return_token_ids":true`, a migratable stream's leg).
    """
    key = (
        b'"return_token_ids":true,"kv_transfer_params":' if token_ids else b'"kv_transfer_params":'
    )
    text = raw.strip()
    if text[:1] == b"{" and text[-1:] == b"}" and "kv_transfer_params" not in body and body:
        return text[:-1] + b"," + key, b"}"
    rest = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    sep = b"," if rest else b""
    return _json(rest)[:-1] + sep + key, b"}"


def takes_first_token(req: ClientRequest) -> bool:
    """Whether `req` may take its first token from prefill: streamed, one choice, one prompt,
    and nothing that makes tokens 2..n depend on token 1 other than through the prompt (seed,
    stop strings, presence/frequency penalties, min_tokens) or that needs per-token output
    (logprobs, echo)."""
    body = req.body
    if not req.stream or not body.keys() <= _FIELDS[req.endpoint]:
        return False
    if body.get("n") not in (None, 1):
        return False
    for name, neutral in _UNSET.items():
        value = body.get(name)
        # `type(...)` too: True == 1 and 0 == False in Python, and `seed: 0` is a seed
        if value is not None and not any(value == n and type(value) is type(n) for n in neutral):
            return False
    if req.endpoint == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return False  # a batch of prompts: several choices
    return True


def requested_max(req: ClientRequest) -> int | None:
    """Output tokens the client asked for (None: up to the model's length)."""
    body = req.body
    if req.endpoint == CHAT:
        value = body.get("max_completion_tokens") or body.get("max_tokens")
        return value if isinstance(value, int) else None
    value = body.get("max_tokens", _COMPLETIONS_MAX_TOKENS)
    return value if isinstance(value, int) else None


def continuation_body(
    req: ClientRequest,
    prompt_token_ids: list[int],
    kv_transfer_params: bytes | None,
    token_ids: bool = False,
) -> bytes:
    """The `/v1/completions` body of the decode leg after the first token from prefill:
    `prompt_token_ids` (prefill's prompt ids plus the first token), one token less to generate,
    the client's sampling fields, prefill's `kv_transfer_params` (JSON bytes) as returned.
    Without them (None) decode computes the whole prompt itself: the body of a decode that
    takes over from one that could not be reached. `token_ids` asks decode for its tokens'
    ids (`return_token_ids`; `pdplane.gateway.splice.Splice.token_ids`)."""
    body = req.body
    out: dict[str, Any] = {"prompt": prompt_token_ids}
    if "model" in body:
        out["model"] = body["model"]
    wanted = requested_max(req)
    # None: up to the model's length, which vLLM computes from decode's (longer) prompt.
    out["max_tokens"] = None if wanted is None else wanted - 1
    for name in _TO_DECODE:
        if name in body:
            out[name] = body[name]
    out["stream"] = True
    if token_ids:
        out["return_token_ids"] = True
    text = _json(out)
    if kv_transfer_params is None:
        return text
    return text[:-1] + b',"kv_transfer_params":' + kv_transfer_params + b"}"


#: Fields a resumed stream's leg gets besides `_TO_DECODE` (their effect across the seam is in
#: docs/migration.md: a seed restarts its generator, penalties count only the
#: new leg's output).
_RESUMED = ("seed", "presence_penalty", "frequency_penalty", "logprobs", "stop")


def migratable(req: ClientRequest, detokenizer: bool = False) -> bool:
    """Whether a stream of `req` can continue on another decode from the tokens it sent:
    streamed, one prompt, no `echo`, and only fields whose meaning a `/v1/completions` leg on
    the prompt's token ids keeps (tools, structured outputs and the like are not resumed).
    With `n` > 1 each unfinished choice continues on its own leg (`resumed_body` with its
    `choice`; `pdplane.gateway.fanout`).

    `stop` strings only with a `detokenizer` (the gateway has the model's tokenizer): vLLM
    holds back the last (longest stop string - 1) characters of such a stream until it can
    tell they start none, so the tokens sent before a seam may hold text the client never
    got; only the tokenizer tells which (`pdplane.gateway.migration.stop_seam`)."""
    body = req.body
    if not req.stream or not body.keys() <= _FIELDS[req.endpoint]:
        return False
    n = body.get("n")
    if not (n is None or (type(n) is int and n >= 1)) or body.get("echo") not in (None, False):
        return False
    if body.get("stop") not in (None, "", []) and not detokenizer:
        return False
    if req.endpoint == CHAT:
        return True
    prompt = body.get("prompt")
    return not (isinstance(prompt, list) and prompt and not isinstance(prompt[0], int))


def with_token_ids(raw: bytes, body: dict[str, Any], kv_transfer_params: bytes | None) -> bytes:
    """The client's body (`raw`, parsed `body`) asking for token ids (`return_token_ids`), with
    prefill's `kv_transfer_params` (JSON bytes) when given: a migratable stream's decode leg."""
    head, tail = decode_body_parts(raw, body, token_ids=True)
    if kv_transfer_params is None:
        return head[: -len(b',"kv_transfer_params":')] + tail
    return head + kv_transfer_params + tail


def resumed_body(
    req: ClientRequest, prompt_token_ids: list[int], sent: int, choice: int = 0
) -> dict[str, Any]:
    """The `/v1/completions` request that continues a stream (or its choice `choice` of
    `n` > 1) after `sent` output tokens: `prompt_token_ids` (the prompt's ids plus the `sent`
    tokens'), the client's limit less `sent` (None: up to the model's length), `min_tokens`
    less `sent`, the client's sampling fields, one choice (`n` is not passed on). A `seed`
    becomes seed + `choice`: vLLM seeds choice i of `n` > 1 so. Streamed with token ids (a
    later loss resumes from them again)."""
    body = req.body
    out: dict[str, Any] = {"prompt": prompt_token_ids}
    if "model" in body:
        out["model"] = body["model"]
    wanted = requested_max(req)
    out["max_tokens"] = None if wanted is None else max(1, wanted - sent)
    for name in (*_TO_DECODE, *_RESUMED):
        if name in body:
            out[name] = body[name]
    if req.endpoint == CHAT:
        # chat's logprobs (`logprobs: true`, `top_logprobs: k`) are completions' `logprobs: k`
        if body.get("logprobs") is True:
            top = body.get("top_logprobs")
            out["logprobs"] = top if isinstance(top, int) and not isinstance(top, bool) else 0
        else:
            out.pop("logprobs", None)
    seed = out.get("seed")
    if choice and type(seed) is int:
        out["seed"] = seed + choice
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > sent:
        out["min_tokens"] = min_tokens - sent
    out["stream"] = True
    out["return_token_ids"] = True
    return out
