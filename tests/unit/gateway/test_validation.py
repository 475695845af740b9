"""Client request validation: 400 before any upstream, with an OpenAI-style message."""

from __future__ import annotations

import json

import pytest

from pdplane.gateway.errors import GatewayError
from pdplane.gateway.validation import (
    CHAT,
    COMPLETIONS,
    EMPTY_CONVERSATION,
    EMPTY_PROMPT,
    parse_request,
)


def _raw(body: object) -> bytes:
    return json.dumps(body).encode()


def test_valid_chat_request_keeps_the_body_and_reads_lengths() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 9,
            "max_completion_tokens": 7, "stream": True, "user": "u1", "top_k": 3}  # fmt: skip
    req = parse_request(CHAT, _raw(body))
    assert req.body == body
    assert (req.model, req.stream, req.max_tokens, req.routing_key) == ("m", True, 7, "u1")
    assert req.prompt_tokens == 4 + 2  # 4 template tokens + ceil(5 bytes / 4)


def test_routing_key_header_wins_over_user() -> None:
    req = parse_request(COMPLETIONS, _raw({"model": "m", "prompt": "x", "user": "u"}), "key")
    assert req.routing_key == "key"


def test_a_request_without_model_is_for_the_default_model() -> None:
    # As with `vllm serve`: the endpoint resolves "" to the fleet's model.
    assert parse_request(COMPLETIONS, _raw({"prompt": "x"})).model == ""


@pytest.mark.parametrize(
    ("endpoint", "raw", "param", "fragment"),
    [
        (COMPLETIONS, b"{not json", None, "not valid JSON"),
        (COMPLETIONS, b"[1, 2]", None, "JSON object"),
        (COMPLETIONS, _raw({"model": "m"}), "prompt", EMPTY_PROMPT),
        (COMPLETIONS, _raw({"model": "m", "prompt": ""}), "prompt", EMPTY_PROMPT),
        (COMPLETIONS, _raw({"model": "m", "prompt": []}), "prompt", EMPTY_PROMPT),
        (COMPLETIONS, _raw({"model": "m", "prompt": [[]]}), "prompt", EMPTY_PROMPT),
        (CHAT, _raw({"model": "m"}), "messages", "'messages' is a required property"),
        (CHAT, _raw({"model": "m", "messages": []}), None, EMPTY_CONVERSATION),
        (COMPLETIONS, _raw({"model": "", "prompt": "x"}), "model", "model"),
        (COMPLETIONS, _raw({"model": 3, "prompt": "x"}), "model", "model"),
        (COMPLETIONS, _raw({"model": "m", "prompt": "x", "stream": "yes"}), "stream", "stream"),
        (COMPLETIONS, _raw({"model": "m", "prompt": "x", "max_tokens": "5"}), "max_tokens", ""),
        (COMPLETIONS, _raw({"model": "m", "prompt": [[1, -2]]}), "prompt", "prompt"),
        (COMPLETIONS, _raw({"model": "m", "prompt": ["a", "b"]}), "prompt", "batched prompts (2)"),
        (COMPLETIONS, _raw({"model": "m", "prompt": [[1, 2], [3, 4]]}), "prompt", "batched"),
        (COMPLETIONS, _raw({"model": "m", "prompt": "x", "use_beam_search": True}),
         "use_beam_search", "beam search"),
        (COMPLETIONS, _raw({"model": "m", "prompt": "x", "max_tokens": 0}), "max_tokens",
         "at least 1"),
        (CHAT, _raw({"model": "m", "messages": [{"role": "user", "content": "x"}],
                     "max_completion_tokens": -3}), "max_completion_tokens", "at least 1"),
        (COMPLETIONS, _raw({"model": "m", "prompt": "x", "stream_options": {}}),
         "stream_options", "stream=True"),
        (CHAT, _raw({"model": "m", "messages": [{"role": "user", "content": "x"}],
                     "stream": True, "stream_options": {"include_usage": "y"}}),
         "stream_options.include_usage", ""),
    ],
)  # fmt: skip
def test_bad_requests_are_400_with_the_offending_field(
    endpoint: str, raw: bytes, param: str | None, fragment: str
) -> None:
    with pytest.raises(GatewayError) as info:
        parse_request(endpoint, raw)  # type: ignore[arg-type]
    err = info.value
    assert err.status == 400
    assert err.param == param
    assert fragment in err.message
    body = json.loads(err.body())
    assert body["error"]["code"] == 400
    assert body["error"]["type"] == "BadRequestError"
    assert body["error"]["message"] == err.message


@pytest.mark.parametrize("prompt", ["one", ["one"], [1, 2, 3], [[1, 2, 3]]])
def test_a_single_prompt_in_any_openai_form_is_accepted(prompt: object) -> None:
    req = parse_request(COMPLETIONS, _raw({"model": "m", "prompt": prompt}))
    assert req.body["prompt"] == prompt
    assert req.prompt_tokens > 0
