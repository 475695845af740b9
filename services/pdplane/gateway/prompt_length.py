"""Prompt-length estimates for `Schedule`, without a tokenizer.

The gateway has no tokenizer (loading one per model would cost memory and startup time, and the
scheduler only needs an order of magnitude for its length and KV-room checks). Estimates:

- token ids (`prompt: [1, 2, 3]`): exact, the list length;
- text: ceil(UTF-8 bytes / 4) (~4 bytes per token for English BPE vocabularies; CJK text is ~3
  bytes per character and tokenizes to ~1 token per character, so it is underestimated ~1.3x);
- chat: the text of every message's content parts, plus 4 tokens per message for the chat
  template's role markers.

For several prompts (`prompt: ["a", "b"]`) the estimate is their sum, since one request computes
all of them on the same pair.
"""

from __future__ import annotations

from typing import Any

__all__ = ["estimate_chat_tokens", "estimate_prompt_tokens", "estimate_text_tokens"]

_BYTES_PER_TOKEN = 4
_TEMPLATE_TOKENS_PER_MESSAGE = 4


def estimate_text_tokens(text: str) -> int:
    """ceil(UTF-8 length / 4) tokens for `text`; at least 1 for non-empty text."""
    return -(-len(text.encode()) // _BYTES_PER_TOKEN)


def estimate_prompt_tokens(prompt: str | list[Any]) -> int:
    """Tokens of a completions `prompt` (str, list[str], list[int] or list[list[int]])."""
    if isinstance(prompt, str):
        return estimate_text_tokens(prompt)
    total = 0
    for item in prompt:
        if isinstance(item, str):
            total += estimate_text_tokens(item)
        elif isinstance(item, list):
            total += len(item)
        else:
            total += 1
    return total


def _content_text_tokens(content: Any) -> int:
    if isinstance(content, str):
        return estimate_text_tokens(content)
    if isinstance(content, list):
        return sum(
            estimate_text_tokens(part["text"])
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return 0


def estimate_chat_tokens(messages: list[dict[str, Any]]) -> int:
    """Tokens of chat `messages`: content text plus 4 template tokens per message."""
    return sum(
        _TEMPLATE_TOKENS_PER_MESSAGE + _content_text_tokens(m.get("content")) for m in messages
    )
