"""The gateway's exact prompt ids equal the `prompt_token_ids` real vLLM reports (tiny model):
completions text, token-id prompts and chat through the model's chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdplane.core.prefix_hash import block_hashes
from pdplane.gateway.prompt_ids import PromptTokenizer, exact_prompt
from pdplane.gateway.validation import CHAT, COMPLETIONS, Endpoint, parse_request
from pdplane.launch.vllm_cpu import VllmCpuInstance
from tests.e2e.conftest import MODEL_NAME

pytestmark = pytest.mark.vllm

_LONG = " ".join(["the prefill instance holds the cache block for decode"] * 30)

CASES: list[tuple[Endpoint, dict[str, Any]]] = [
    (COMPLETIONS, {"prompt": "the quick red river"}),
    (COMPLETIONS, {"prompt": _LONG}),
    (COMPLETIONS, {"prompt": "no special tokens", "add_special_tokens": False}),
    (COMPLETIONS, {"prompt": [5, 17, 300, 42, 7]}),
    (COMPLETIONS, {"prompt": [[9, 8, 7, 6]]}),
    (CHAT, {"messages": [{"role": "user", "content": "hold the block"}]}),
    (
        CHAT,
        {
            "messages": [
                {"role": "system", "content": "you are a cache"},
                {"role": "user", "content": _LONG},
                {"role": "assistant", "content": "the block is held"},
                {"role": "user", "content": "now pull it"},
            ]
        },
    ),
    (
        CHAT,
        {
            "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    ),
]


@pytest.mark.parametrize(("endpoint", "body"), CASES)
def test_gateway_ids_equal_vllms_prompt_token_ids(
    tiny_model: Path, vllm_reference: VllmCpuInstance, endpoint: Endpoint, body: dict[str, Any]
) -> None:
    full = {"model": MODEL_NAME, "max_tokens": 1, "return_token_ids": True, **body}
    r = httpx.post(f"{vllm_reference.url}{endpoint}", json=full, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    vllm_ids = (
        answer["prompt_token_ids"] if endpoint == CHAT else answer["choices"][0]["prompt_token_ids"]
    )
    tok = PromptTokenizer(tiny_model)
    req = exact_prompt(tok, parse_request(endpoint, json.dumps(full).encode()), 4096, (16, 128))
    assert req.prompt_tokens == len(vllm_ids) == answer["usage"]["prompt_tokens"]
    assert req.prefix_hashes == {16: block_hashes(vllm_ids, 16), 128: block_hashes(vllm_ids, 128)}
    ids = tok.chat_ids(full, 4096) if endpoint == CHAT else tok.completion_ids(full, 4096)
    assert ids == vllm_ids
