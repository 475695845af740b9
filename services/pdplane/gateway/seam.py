"""A resumed leg's events as the client's stream continues them (request migration).

A stream resumed on another decode (`pdplane.gateway.resume`, `pdplane.gateway.migration`)
continues on a `/v1/completions` leg. Its events need, besides `pdplane.gateway.splice.Splice`'s
rewriting:

- `Seam`: what the client already has dropped (a stream with stop strings resumes before text
  vLLM had held back: the first characters of the new leg's text, and, with completions
  `logprobs`, its first tokens' logprobs), and completions' `text_offset` moved on from the
  client's (vLLM counts it from the leg's own start, by each token's text);
- `chat_logprobs`: chat's `logprobs` object built from the completions leg's, as vLLM 0.32's
  chat server writes it (`vllm/entrypoints/openai/serving_chat.py`, `_create_chat_logprobs`):
  per token `{"token", "logprob", "bytes", "top_logprobs"}`, `bytes` the token's UTF-8 (bad
  bytes replaced), `top_logprobs` the first `top_logprobs` items of the engine's dict (the
  sampled token first; the completions leg, asked for `logprobs: top_logprobs`, returns the
  first top_logprobs + 1).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic_core import from_json

from pdplane.gateway.replies import sse_event

__all__ = ["Seam", "chat_logprobs", "chat_top_logprobs", "parsed"]


def parsed(data: bytes) -> Any:
    """`data` (JSON bytes) parsed; None when it is not JSON. pydantic-core's parser (Rust)
    takes ~2 us for a token chunk where `json.loads` takes ~8; `json.loads` is the fallback
    for what only it reads (a lone UTF-16 surrogate escape)."""
    try:
        return from_json(data)
    except ValueError:
        try:
            return json.loads(data)
        except ValueError:
            return None


def chat_top_logprobs(body: dict[str, Any]) -> int | None:
    """A chat request's (`body`) `top_logprobs` when it asked for logprobs (0 when it gave
    none), else None."""
    if body.get("logprobs") is not True:
        return None
    top = body.get("top_logprobs")
    return top if isinstance(top, int) and not isinstance(top, bool) else 0


def _entry(token: str, logprob: object) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace"))}


def chat_logprobs(logprobs: dict[str, Any], top: int) -> dict[str, Any]:
    """Chat's `logprobs` object from a completions chunk's (`tokens`, `token_logprobs`,
    `top_logprobs` lists), with `top` alternatives per token (see the module docstring)."""
    tokens = logprobs.get("tokens")
    values = logprobs.get("token_logprobs")
    tops = logprobs.get("top_logprobs")
    content = []
    if isinstance(tokens, list) and isinstance(values, list):
        for i, (token, value) in enumerate(zip(tokens, values, strict=False)):
            entry = _entry(str(token), value)
            alternatives = tops[i] if isinstance(tops, list) and i < len(tops) else None
            items = list(alternatives.items())[:top] if isinstance(alternatives, dict) else []
            entry["top_logprobs"] = [_entry(str(t), lp) for t, lp in items]
            content.append(entry)
    return {"content": content}


class Seam:
    """Fixes a resumed leg's completions events (see the module docstring).

    Args:
        overlap: characters at the start of the leg's text the client already has.
        repeated: the leg's first tokens whose logprobs the client already has.
        text_offset: the `text_offset` the client's stream has reached (added to the leg's
            completions `text_offset`; None: the client did not ask for them).
    """

    __slots__ = ("_offset", "_overlap", "_repeated")

    def __init__(self, overlap: int = 0, repeated: int = 0, text_offset: int | None = None):
        self._overlap = overlap
        self._repeated = repeated
        self._offset = text_offset

    @property
    def active(self) -> bool:
        """Whether events still need fixing."""
        return bool(self._overlap or self._repeated or self._offset)

    def rewrite(self, events: bytes) -> bytes:
        """Decode's whole SSE `events` (completions chunks) fixed."""
        out = []
        for event in events.split(b"\n\n"):
            if not event:
                continue
            obj = parsed(event[6:]) if event.startswith(b"data: {") else None
            choices = obj.get("choices") if isinstance(obj, dict) else None
            if not isinstance(obj, dict) or not isinstance(choices, list) or not self.active:
                out.append(event + b"\n\n")
                continue
            for c in choices:
                if isinstance(c, dict):
                    self._choice(c)
            out.append(sse_event(obj))
        return b"".join(out)

    def _choice(self, choice: dict[str, Any]) -> None:
        text = choice.get("text")
        if isinstance(text, str) and self._overlap:
            cut = min(self._overlap, len(text))
            choice["text"], self._overlap = text[cut:], self._overlap - cut
        logprobs = choice.get("logprobs")
        if not isinstance(logprobs, dict):
            return
        if self._repeated:
            tokens = logprobs.get("tokens")
            cut = min(self._repeated, len(tokens) if isinstance(tokens, list) else 0)
            for key, value in logprobs.items():
                if isinstance(value, list):
                    logprobs[key] = value[cut:]
            self._repeated -= cut
        offsets = logprobs.get("text_offset")
        if self._offset and isinstance(offsets, list):
            logprobs["text_offset"] = [
                o + self._offset if isinstance(o, int) else o for o in offsets
            ]
