"""Prefill and decode leg bodies built from a client body."""

from __future__ import annotations

import json

from pdplane.core.kv_params import PrefillRequestParams
from pdplane.gateway.bodies import decode_body, decode_body_parts, prefill_body
from pdplane.gateway.validation import CHAT, COMPLETIONS


def test_chat_prefill_body_forces_one_token_and_drops_streaming_and_min_tokens() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100,
            "min_tokens": 5, "stream": True, "stream_options": {"include_usage": True}, "n": 2,
            "temperature": 0.5}  # fmt: skip
    out = json.loads(prefill_body(CHAT, body, "rid-1"))
    assert out == {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "n": 1,
        "temperature": 0.5,
        "kv_transfer_params": PrefillRequestParams("rid-1").to_dict(),
    }
    assert body["max_tokens"] == 100 and "stream_options" in body  # client body untouched


def test_prefill_names_the_decode_for_push_only_when_one_sequence_is_asked() -> None:
    one = {"model": "m", "prompt": "p"}
    params = json.loads(prefill_body(COMPLETIONS, one, "r", "decode-1", "h:1"))
    assert params["kv_transfer_params"] == PrefillRequestParams("r", "decode-1", "h:1").to_dict()
    many = {"model": "m", "prompt": "p", "n": 3}
    params = json.loads(prefill_body(COMPLETIONS, many, "r", "decode-1", "h:1"))
    assert params["kv_transfer_params"] == PrefillRequestParams("r").to_dict()  # pull


def test_completions_prefill_body_has_no_max_completion_tokens() -> None:
    out = json.loads(prefill_body(COMPLETIONS, {"model": "m", "prompt": "p",
                                                "max_completion_tokens": 9}, "r"))  # fmt: skip
    assert "max_completion_tokens" not in out
    assert out["max_tokens"] == 1


def test_decode_body_is_the_original_plus_params_and_the_split_form_is_identical() -> None:
    body = {"model": "m", "prompt": "p", "stream": True, "kv_transfer_params": {"stale": 1}}
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2]}
    kv = json.dumps(params).encode()
    whole = decode_body(json.dumps(body).encode(), body, kv)
    assert json.loads(whole) == {**body, "kv_transfer_params": params}
    assert whole.count(b"kv_transfer_params") == 1  # the client's own value is replaced
    head, tail = decode_body_parts(json.dumps(body).encode(), body)
    assert json.loads(head + kv + tail) == json.loads(whole)


def test_decode_body_reuses_the_client_bytes() -> None:
    raw = b' {"model": "m",\n "prompt": "caf\xc3\xa9 \\u00e9", "n": 2}\n'
    body = json.loads(raw)
    whole = decode_body(raw, body, b'{"a":1}')
    assert (
        whole
        == b'{"model": "m",\n "prompt": "caf\xc3\xa9 \\u00e9", "n": 2,"kv_transfer_params":{"a":1}}'
    )
    assert json.loads(whole) == {**body, "kv_transfer_params": {"a": 1}}


def test_decode_body_of_non_utf8_json_is_re_encoded() -> None:
    body = {"model": "m", "prompt": "p"}
    raw = json.dumps(body).encode("utf-16")  # json.loads accepts it; splicing would not work
    whole = decode_body(raw, body, b"{}")
    assert json.loads(whole) == {**body, "kv_transfer_params": {}}
