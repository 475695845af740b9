"""Request parsing, vLLM's 4xx errors and deterministic output."""

from __future__ import annotations

import pytest

from pdplane.sim.protocol import SimApiError, parse_request
from pdplane.sim.tokens import VOCAB, chat_prompt_tokens, count_text_tokens, generate


def _parse(body: object, chat: bool = False, max_model_len: int = 64):
    return parse_request(body, chat=chat, model="m", max_model_len=max_model_len, default_seed=7)


def test_output_is_a_pure_function_of_prompt_and_seed() -> None:
    a = generate("hello world", 0, 32)
    assert a == generate("hello world", 0, 32)
    assert a != generate("hello world", 1, 32)
    assert a != generate("hello there", 0, 32)
    assert all(t in VOCAB for t in a)
    assert generate("hello world", 0, 5) == a[:5]  # prefill's first token == decode's first


def test_token_counts() -> None:
    assert count_text_tokens("Hello, world!") == 4
    assert count_text_tokens("") == 1
    assert chat_prompt_tokens([{"role": "user", "content": "a b"}]) == 2 + 4 + 3


def test_max_tokens_beyond_max_model_len_is_vllms_400() -> None:
    with pytest.raises(SimApiError) as err:
        _parse({"prompt": "x", "max_tokens": 65})
    assert err.value.status == 400
    assert err.value.param == "max_tokens"
    assert "cannot be greater than max_model_len=64" in err.value.message
    assert err.value.body()["error"]["code"] == 400


def test_chat_names_max_completion_tokens() -> None:
    with pytest.raises(SimApiError) as err:
        _parse(
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 99}, chat=True
        )
    assert err.value.param == "max_completion_tokens"


def test_prompt_longer_than_context_is_400() -> None:
    with pytest.raises(SimApiError) as err:
        _parse({"prompt": list(range(64)), "max_tokens": 1})
    assert "maximum context length is 64 tokens" in err.value.message


def test_max_tokens_is_clamped_to_the_room_left() -> None:
    req = _parse({"prompt": list(range(60)), "max_tokens": 10})
    assert (req.prompt_tokens, req.max_tokens) == (60, 4)
    assert _parse({"prompt": "a b"}).max_tokens == 62  # default: all the room left


def test_unknown_model_is_404() -> None:
    with pytest.raises(SimApiError) as err:
        _parse({"model": "other", "prompt": "x"})
    assert (err.value.status, err.value.err_type) == (404, "NotFoundError")


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": 3},
        {"prompt": "x", "n": 17},
        {"prompt": "x", "n": 0},
        {"prompt": "x", "max_tokens": "5"},
        {"prompt": "x", "max_tokens": 0},
        {"prompt": "x", "stream_options": {"include_usage": True}},
        {"prompt": "x", "kv_transfer_params": [1]},
        [1, 2],
        # token ids outside uint32 once crashed the engine loop (KV events) and froze the sim
        {"prompt": [1, 2**32]},
        {"prompt": [-1, 2]},
    ],
)
def test_malformed_requests_are_400(body: object) -> None:
    with pytest.raises(SimApiError) as err:
        _parse(body)
    assert err.value.status == 400


def test_request_seed_wins_over_the_default() -> None:
    assert _parse({"prompt": "x"}).seed == 7
    assert _parse({"prompt": "x", "seed": 3}).seed == 3
    req = _parse({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    assert req.stream and req.include_usage
