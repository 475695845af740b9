"""Exact prompt ids at the gateway: the tokenizer's ids, hashed per block size; bounded work;
unknown shapes and a missing tokenizer fall back to estimates."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from pdplane.core.prefix_hash import block_hashes
from pdplane.gateway.errors import GatewayError
from pdplane.gateway.prompt_ids import (
    PromptTokenizer,
    TokenizerSet,
    exact_prompt,
    exact_prompt_async,
    load_tokenizers,
)
from pdplane.gateway.validation import CHAT, COMPLETIONS, ClientRequest, parse_request
from pdplane.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    cache = Path(os.environ.get("PDPLANE_MODEL_CACHE", Path.home() / ".cache/pdplane/models"))
    return build_tiny_model(cache)


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> PromptTokenizer:
    return PromptTokenizer(tiny_dir)


def _req(endpoint: Any, **body: Any) -> ClientRequest:
    return parse_request(endpoint, json.dumps({"model": "tiny", **body}).encode())


def test_completion_text_ids_are_the_tokenizers_and_token_ids_pass_as_given(
    tok: PromptTokenizer, tiny_dir: Path
) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_dir)
    text = "the prefill cache holds a block of tokens"
    assert tok.completion_ids({"prompt": text}, 4096) == hf.encode(text)
    assert tok.completion_ids({"prompt": [text]}, 4096) == hf.encode(text)
    assert tok.completion_ids({"prompt": [5, 6, 7]}, 4096) == [5, 6, 7]
    assert tok.completion_ids({"prompt": [[5, 6]]}, 4096) == [5, 6]


def test_chat_ids_follow_the_chat_template_with_vllms_defaults(tok: PromptTokenizer) -> None:
    messages = [{"role": "user", "content": "hold the block"}]
    ids = tok.chat_ids({"messages": messages}, 4096)
    assert ids is not None
    assert tok._tok.decode(ids) == "<s><|user|>hold the block</s><|assistant|>"
    no_prompt = tok.chat_ids({"messages": messages, "add_generation_prompt": False}, 4096)
    assert no_prompt is not None
    assert tok._tok.decode(no_prompt) == "<s><|user|>hold the block</s>"


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        (COMPLETIONS, {"prompt": "x", "truncate_prompt_tokens": 3}),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": []}),
        (CHAT, {"messages": [{"role": "developer", "content": "x"}]}),
        (CHAT, {"messages": [{"role": "user", "content": "x", "name": "bob"}]}),
    ],
)
def test_shapes_not_reproduced_keep_the_estimate(
    tok: PromptTokenizer, endpoint: Any, body: dict[str, Any]
) -> None:
    req = _req(endpoint, **body)
    assert exact_prompt(tok, req, 4096, (16,)) is req


def test_exact_prompt_hashes_the_ids_at_every_block_size(tok: PromptTokenizer) -> None:
    text = " ".join(["decode pulls the prefill blocks"] * 20)
    req = exact_prompt(tok, _req(COMPLETIONS, prompt=text), 4096, (4, 16))
    ids = tok.completion_ids({"prompt": text}, 4096)
    assert ids is not None and req.prompt_tokens == len(ids)
    assert req.prefix_hashes == {4: block_hashes(ids, 4), 16: block_hashes(ids, 16)}
    assert len(req.prefix_hashes[16]) == len(ids) // 16 > 0


def test_the_ids_a_request_keeps_take_four_bytes_a_token(tok: PromptTokenizer) -> None:
    # Kept for the request's life (a prefix warm sends a part of them): a list of ints would
    # take ~36 bytes a token, ~1 MB for a 32k-token prompt.
    text = "the cache " * 8_000
    req = exact_prompt(tok, _req(COMPLETIONS, prompt=text), 65_536, (16,))
    ids = tok.completion_ids({"prompt": text}, 65_536)
    assert ids is not None and len(ids) > 10_000
    assert list(req.prompt_ids) == ids
    assert sys.getsizeof(req.prompt_ids) <= 4 * len(ids) + 256


async def test_a_long_prompt_is_tokenized_off_the_loop_with_the_same_result(
    tok: PromptTokenizer,
) -> None:
    req = _req(COMPLETIONS, prompt="the cache " * 1000)  # > OFFLOAD_CHARS
    assert await exact_prompt_async(tok, req, 8192, (16,)) == exact_prompt(tok, req, 8192, (16,))


def test_too_long_prompts_are_refused_as_vllm_refuses_them(tok: PromptTokenizer) -> None:
    with pytest.raises(GatewayError, match="contains 8 input tokens") as err:
        exact_prompt(tok, _req(COMPLETIONS, prompt=list(range(8))), 8, (4,))
    assert err.value.status == 400
    # Beyond max_model_len x the longest token's characters: refused before tokenizing.
    text = "a" * (8 * tok.max_chars_per_token + 1)
    with pytest.raises(GatewayError, match="characters"):
        exact_prompt(tok, _req(CHAT, messages=[{"role": "user", "content": text}]), 8, (4,))


def test_a_missing_tokenizer_folder_is_no_override_and_says_so(
    caplog: pytest.LogCaptureFixture, tiny_dir: Path
) -> None:
    with caplog.at_level(logging.INFO, "pdplane.gateway.prompt_ids"):
        none = load_tokenizers(None)
        missing = load_tokenizers("/nonexistent/model")
        mixed = load_tokenizers(f"tiny={tiny_dir},other=/nonexistent/model")
    assert not none.exact and not missing.exact and none.get("tiny") is None
    assert mixed.exact and mixed.get("tiny") is not None and mixed.get("other") is None
    assert mixed.describe() == {"tiny": str(tiny_dir)}
    text = caplog.text
    assert text.count("the fleet's is used") == 2
    assert "'/nonexistent/model' not loaded" in text
    assert TokenizerSet({}).describe() == {}
