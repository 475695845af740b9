"""The kv_transfer_params protocol: round trips, NIXL-compatible names, clear errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pdplane.core.kv_params import (
    PROTOCOL_VERSION,
    DecodeRequestParams,
    KvParamsError,
    PrefillRequestParams,
    make_transfer_id,
    prompt_fingerprint,
)


def _decode_params() -> DecodeRequestParams:
    return DecodeRequestParams(
        request_id="req-1",
        transfer_id="req-1.ab12",
        engine_id="prefill-0",
        kv_endpoint="127.0.0.1:50100",
        block_ids=[7, 3, 9],
        num_tokens=300,
        kv_layout="L2.H2.D32.B128.float32",
        transport="tcp",
        tp_size=1,
    )


def test_prefill_params_ask_for_remote_decode_and_round_trip() -> None:
    d = PrefillRequestParams("req-1").to_dict()
    assert d["do_remote_decode"] is True and d["do_remote_prefill"] is False
    assert PrefillRequestParams.from_dict(json.loads(json.dumps(d))).request_id == "req-1"


def test_decode_params_round_trip_through_json() -> None:
    params = _decode_params()
    d = json.loads(json.dumps(params.to_dict()))
    assert DecodeRequestParams.from_dict(d) == params


def test_decode_params_carry_nixl_field_names() -> None:
    d = _decode_params().to_dict()
    assert d["do_remote_prefill"] is True
    assert d["remote_engine_id"] == "prefill-0"
    assert d["remote_block_ids"] == [7, 3, 9]
    assert (d["remote_host"], d["remote_port"]) == ("127.0.0.1", 50100)
    assert d["pdplane_version"] == PROTOCOL_VERSION


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.pop("pdplane_transfer_id"), "pdplane_transfer_id"),
        (lambda d: d.update(remote_block_ids=[1, "2"]), "remote_block_ids"),
        (lambda d: d.update(pdplane_num_tokens="300"), "pdplane_num_tokens"),
        (lambda d: d.update(pdplane_version=PROTOCOL_VERSION + 1), "pdplane_version"),
        (lambda d: d.update(do_remote_prefill=False), "do_remote_prefill"),
    ],
)
def test_decode_params_errors_name_the_field(mutate, field) -> None:  # type: ignore[no-untyped-def]
    d = _decode_params().to_dict()
    mutate(d)
    with pytest.raises(KvParamsError, match=field):
        DecodeRequestParams.from_dict(d)


def test_prompt_hash_is_optional_and_round_trips() -> None:
    plain = _decode_params().to_dict()
    assert "pdplane_prompt_hash" not in plain
    assert DecodeRequestParams.from_dict(plain).prompt_hash == ""
    hashed = dataclasses.replace(_decode_params(), prompt_hash=prompt_fingerprint([1, 2, 3]))
    assert DecodeRequestParams.from_dict(hashed.to_dict()).prompt_hash == hashed.prompt_hash


def test_prompt_fingerprint_tells_prompts_apart() -> None:
    assert prompt_fingerprint([1, 2, 3]) == prompt_fingerprint((1, 2, 3))
    assert prompt_fingerprint([1, 2, 3]) != prompt_fingerprint([1, 2, 4])
    assert prompt_fingerprint([1, 2, 3]) != prompt_fingerprint([1, 2, 3, 0])
    assert len(prompt_fingerprint(range(4096))) == 16


def test_prefill_params_require_request_id() -> None:
    with pytest.raises(KvParamsError, match="pdplane_request_id"):
        PrefillRequestParams.from_dict({"do_remote_decode": True})


def test_prefill_params_carry_the_decode_target_when_given() -> None:
    params = PrefillRequestParams("req-1", "decode-0", "127.0.0.1:50200")
    d = json.loads(json.dumps(params.to_dict()))
    assert d["pdplane_decode_engine_id"] == "decode-0"
    assert d["pdplane_decode_kv_endpoint"] == "127.0.0.1:50200"
    assert PrefillRequestParams.from_dict(d) == params


def test_prefill_params_without_decode_target_stay_as_before() -> None:
    d = PrefillRequestParams("req-1").to_dict()
    assert not any(k.startswith("pdplane_decode_") for k in d)
    back = PrefillRequestParams.from_dict(d)
    assert back.decode_kv_endpoint is None and back.decode_engine_id is None


def test_prefill_params_carry_the_gateways_transfer_id_when_given() -> None:
    assert "pdplane_transfer_id" not in PrefillRequestParams("req-1").to_dict()
    params = PrefillRequestParams("req-1", transfer_id=make_transfer_id("req-1"))
    d = json.loads(json.dumps(params.to_dict()))
    assert PrefillRequestParams.from_dict(d) == params


@pytest.mark.parametrize("bad", ["a b", "x\nlog line", "t" * 129, 7])
def test_prefill_params_reject_a_transfer_id_unsafe_in_logs_or_too_long(bad: object) -> None:
    d = PrefillRequestParams("req-1").to_dict() | {"pdplane_transfer_id": bad}
    with pytest.raises(KvParamsError, match="pdplane_transfer_id"):
        PrefillRequestParams.from_dict(d)


def test_prefill_params_reject_a_non_string_decode_endpoint() -> None:
    d = PrefillRequestParams("req-1").to_dict() | {"pdplane_decode_kv_endpoint": 50200}
    with pytest.raises(KvParamsError, match="pdplane_decode_kv_endpoint"):
        PrefillRequestParams.from_dict(d)


def test_decode_params_pushed_flag_is_optional_and_round_trips() -> None:
    plain = _decode_params().to_dict()
    assert "pdplane_pushed" not in plain  # unchanged wire form for pull
    assert DecodeRequestParams.from_dict(plain).pushed is False
    pushed = dataclasses.replace(_decode_params(), pushed=True)
    d = json.loads(json.dumps(pushed.to_dict()))
    assert d["pdplane_pushed"] is True
    assert DecodeRequestParams.from_dict(d) == pushed
