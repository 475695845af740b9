"""Deterministic stand-ins for a tokenizer and a sampler.

Token counts only need to be plausible and stable (the scheduler and the KV accounting read
them); output text only needs to be a pure function of (prompt, seed) so that tests can compare
a disaggregated answer with a direct one.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from typing import Any

__all__ = ["VOCAB", "chat_prompt_tokens", "count_text_tokens", "generate", "prompt_key"]

_TOKEN_RE = re.compile(r"\w+|[^\w\s]")
#: Chat template overhead, like a Llama-style template: tokens per message and for the reply.
_PER_MESSAGE_TOKENS = 4
_REPLY_PRIMER_TOKENS = 3

#: Output vocabulary: every generated token is one of these words with a leading space.
_WORDS = (
    "the of and to in is was for on that with as by at from his an were are which this be "
    "has had it or not first new one their its after who they have her she two been other "
    "when there all during into school time may years more most only over city some world "
    "would where later up such used many can state about national out known university "
    "united then made"
)
VOCAB: tuple[str, ...] = tuple(" " + w for w in _WORDS.split())


def count_text_tokens(text: str) -> int:
    """Prompt length of `text` in tokens (words and punctuation marks; at least 1)."""
    return max(1, len(_TOKEN_RE.findall(text)))


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def chat_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """Prompt length of a chat request in tokens, template overhead included."""
    body = sum(count_text_tokens(_content_text(m.get("content"))) for m in messages)
    return body + _PER_MESSAGE_TOKENS * len(messages) + _REPLY_PRIMER_TOKENS


def prompt_key(prompt: Any) -> str:
    """Canonical string of a prompt (text, token ids or chat messages) for seeding."""
    if isinstance(prompt, str):
        return prompt
    return json.dumps(prompt, sort_keys=True, separators=(",", ":"))


def generate(key: str, seed: int, num_tokens: int) -> list[str]:
    """The `num_tokens` output tokens (strings) for a prompt key and seed; pure function."""
    digest = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "little"))
    return rng.choices(VOCAB, k=num_tokens)
