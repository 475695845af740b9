"""Logprobs in vLLM 0.32's shapes, with made-up values that depend on the token only.

A token's logprob is a pure function of its id, and its alternatives are the tokenizer's first
other output tokens (`Tokenizer.alternatives`), so a stream resumed on another sim gives the
same logprobs as one unbroken stream. vLLM's engine returns per token a dict of the sampled
token first, then the top-k (the sim's sampled token is its top 1), and the OpenAI server
writes (`vllm/entrypoints/openai/serving_completion.py`, `serving_chat.py`):

- completions (`logprobs: k`, 0..20): `{"text_offset", "token_logprobs", "tokens",
  "top_logprobs"}`, lists with one entry per token; `top_logprobs` entries are dicts
  token -> logprob of the first k+1 items (at least the sampled token);
- chat (`logprobs: true`, `top_logprobs: k`): `{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}`, the first k items.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdplane.sim.tokens import Tokenizer

__all__ = ["Logprobs", "parse_logprobs"]

#: vLLM's default `--max-logprobs`.
MAX_LOGPROBS = 20


def _logprob(token_id: int, rank: int) -> float:
    return -round(0.05 + (token_id % 89) / 100 + rank * 0.75, 4)


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace"))}


@dataclass(frozen=True, slots=True)
class Logprobs:
    """What a request asked: `chat` shape or completions', `top` alternatives (k)."""

    chat: bool
    top: int

    def _ranked(self, tok: Tokenizer, token_id: int, text: str) -> list[tuple[str, float]]:
        """The engine's dict for one token: the sampled one first, then the next ranks."""
        wanted = max(self.top, 1) if not self.chat else self.top
        ranked = [(text, _logprob(token_id, 0))]
        others = tok.alternatives(token_id, max(wanted - 1, 0))
        ranked += [(t, _logprob(i, r + 1)) for r, (i, t) in enumerate(others)]
        return ranked

    def of(self, tok: Tokenizer, ids: list[int], pieces: list[str], offset: int) -> dict[str, Any]:
        """The `logprobs` object of tokens `ids` (`pieces`: their text); `offset`: the
        characters of the tokens' text before them (completions' `text_offset`, which vLLM
        0.32 advances by each token's text)."""
        if self.chat:
            content = []
            for i, text in zip(ids, pieces, strict=True):
                ranked = self._ranked(tok, i, text)
                entry = _entry(text, ranked[0][1])
                entry["top_logprobs"] = [_entry(t, lp) for t, lp in ranked[: self.top]]
                content.append(entry)
            return {"content": content}
        out: dict[str, Any] = {
            "text_offset": [],
            "token_logprobs": [],
            "tokens": [],
            "top_logprobs": [],
        }
        for i, text in zip(ids, pieces, strict=True):
            ranked = self._ranked(tok, i, text)
            out["text_offset"].append(offset)
            out["token_logprobs"].append(ranked[0][1])
            out["tokens"].append(text)
            out["top_logprobs"].append(dict(ranked[: self.top + 1]))
            offset += len(text)
        return out


def parse_logprobs(body: dict[str, Any], chat: bool) -> Logprobs | str | None:
    """What the request (`body`) asks for (None: no logprobs), or the 400 message."""
    if chat:
        top = body.get("top_logprobs")
        wanted = body.get("logprobs")
        if wanted not in (None, True, False):
            return "logprobs must be a boolean"
        if top is not None and (type(top) is not int or top < 0):
            return "top_logprobs must be a non-negative integer"
        if top and not wanted:
            return "when using `top_logprobs`, `logprobs` must be set to true."
        if not wanted:
            return None
        k = top or 0
    else:
        asked = body.get("logprobs")
        if asked is None:
            return None
        if type(asked) is not int or asked < 0:
            return "logprobs must be a non-negative integer"
        k = asked
    if k > MAX_LOGPROBS:
        return f"Requested sample logprobs of {k}, which is greater than max allowed: " + str(
            MAX_LOGPROBS
        )
    return Logprobs(chat, k)
