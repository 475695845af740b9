"""usage_details: the fleet's cache hit written into usage blocks, nothing else touched."""

from __future__ import annotations

import json

from pdplane.gateway.usage_details import cached_tokens_of, rewrite_events, rewrite_json


def test_prefill_s_hit_comes_from_its_kv_params_else_its_own_usage() -> None:
    kv = {"kv_transfer_params": {"remote_prefill_cached_tokens": 256}}
    assert cached_tokens_of(kv) == 256
    usage = {"usage": {"prompt_tokens_details": {"cached_tokens": 128}}}
    assert cached_tokens_of(usage) == 128
    assert cached_tokens_of({"kv_transfer_params": {}, "usage": {"prompt_tokens": 3}}) is None
    assert cached_tokens_of({"kv_transfer_params": {"remote_prefill_cached_tokens": True}}) is None


def test_only_usage_events_are_rewritten() -> None:
    token = b'data: {"id":"x","choices":[{"text":"\\u00e9 a"}]}\n\n'
    usage = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n'
    done = b"data: [DONE]\n\n"
    out = rewrite_events(token + usage + done, 4)
    assert out.startswith(token) and out.endswith(done)  # byte for byte
    middle = json.loads(out[len(token) + 6 : -len(done)])
    assert middle["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert rewrite_events(token + usage, None) == token + usage


def test_a_non_streamed_answer_gets_the_hit_and_an_error_stays_as_it_is() -> None:
    body = b'{"usage":{"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":5}}}'
    assert json.loads(rewrite_json(body, 0))["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0
    }
    error = b'{"error":{"message":"x"}}'
    assert rewrite_json(error, 3) == error and rewrite_json(body, None) == body
