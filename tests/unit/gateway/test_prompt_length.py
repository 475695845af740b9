"""Prompt-length estimates sent to Schedule."""

from __future__ import annotations

from typing import Any

from pdplane.gateway.prompt_length import (
    estimate_chat_tokens,
    estimate_prompt_tokens,
    estimate_text_tokens,
)


def test_text_is_a_quarter_of_its_utf8_bytes_rounded_up() -> None:
    assert estimate_text_tokens("") == 0
    assert estimate_text_tokens("abcd") == 1
    assert estimate_text_tokens("abcde") == 2
    assert estimate_text_tokens("é" * 4) == 2  # 8 UTF-8 bytes


def test_token_ids_are_counted_exactly_and_batches_summed() -> None:
    assert estimate_prompt_tokens([5, 6, 7]) == 3
    assert estimate_prompt_tokens([[1, 2], [3]]) == 3
    assert estimate_prompt_tokens(["abcd", "abcdefgh"]) == 3


def test_chat_counts_text_parts_plus_template_tokens() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "abcd"},
        {"role": "user", "content": [{"type": "text", "text": "abcdefgh"}, {"type": "image"}]},
    ]
    assert estimate_chat_tokens(messages) == (4 + 1) + (4 + 2)
