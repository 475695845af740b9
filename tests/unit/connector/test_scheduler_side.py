"""SchedulerSide with vLLM's real Request / KVCacheBlocks / RequestStatus types."""

from __future__ import annotations

from types import SimpleNamespace

from pdplane.connector.config import ConnectorConfig
from pdplane.connector.scheduler_side import SchedulerSide
from pdplane.core.instance.layout import fingerprint
from pdplane.core.kv_params import (
    DecodeRequestParams,
    PrefillRequestParams,
    make_transfer_id,
    prompt_fingerprint,
)
from pdplane.v1 import instance_pb2
from tests.unit.connector.conftest import BLOCK, make_blocks, make_request

CFG = ConnectorConfig(kv_port=50100, transfer_timeout_s=7.0)


def _side(layout: instance_pb2.KvLayout) -> SchedulerSide:
    return SchedulerSide(CFG, "prefill-a", layout)


def _finish(request: object, status_name: str) -> None:
    from vllm.v1.request import RequestStatus

    request.status = getattr(RequestStatus, status_name)  # type: ignore[attr-defined]


def _decode_params(layout: instance_pb2.KvLayout, num_tokens: int, **kw: object) -> dict:
    fields: dict = {
        "request_id": "gw-1",
        "transfer_id": "gw-1.abcd",
        "engine_id": "prefill-a",
        "kv_endpoint": "127.0.0.1:50100",
        "block_ids": list(range(100, 100 + -(-num_tokens // BLOCK))),
        "num_tokens": num_tokens,
        "kv_layout": fingerprint(layout),
    }
    fields.update(kw)
    return DecodeRequestParams(**fields).to_dict()


def test_prefill_holds_prompt_blocks_and_returns_decode_params(layout) -> None:
    side = _side(layout)
    req = make_request("cmpl-x-0-1234", 10, PrefillRequestParams("gw-1").to_dict())
    _finish(req, "FINISHED_LENGTH_CAPPED")
    delay, params = side.request_finished(req, [7, 3, 9, 11])
    assert delay is True
    dp = DecodeRequestParams.from_dict(params)
    assert dp.block_ids == [7, 3, 9]  # ceil(10 / 4) blocks, in token order
    assert dp.num_tokens == 10
    assert dp.transfer_id.startswith("gw-1.") and len(dp.transfer_id) > len("gw-1.") + 8
    assert dp.kv_endpoint == "127.0.0.1:50100" and dp.engine_id == "prefill-a"
    assert dp.kv_layout == fingerprint(layout)
    meta = side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert [(h.req_id, h.transfer_id, h.block_ids, h.timeout_s) for h in meta.holds] == [
        ("cmpl-x-0-1234", dp.transfer_id, (7, 3, 9), 7.0)
    ]
    # the next step's metadata starts empty (metadata is one-way, never reused)
    assert side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).is_empty()


def test_transfer_ids_differ_for_the_same_gateway_request(layout) -> None:
    side = _side(layout)
    ids = set()
    for i in range(2):
        req = make_request(f"r{i}", 4, PrefillRequestParams("gw-same").to_dict())
        _finish(req, "FINISHED_STOPPED")
        ids.add(side.request_finished(req, [1])[1]["pdplane_transfer_id"])
    assert len(ids) == 2


def test_prefill_holds_under_the_transfer_id_the_gateway_chose(layout) -> None:
    # The gateway can then free the KV by AbortTransfer without reading prefill's answer.
    side = _side(layout)
    chosen = make_transfer_id("gw-1")
    req = make_request("r", 4, PrefillRequestParams("gw-1", transfer_id=chosen).to_dict())
    _finish(req, "FINISHED_LENGTH_CAPPED")
    assert side.request_finished(req, [1])[1]["pdplane_transfer_id"] == chosen
    meta = side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert [h.transfer_id for h in meta.holds] == [chosen]


def test_transfer_id_keeps_a_safe_bounded_form_of_the_gateway_id() -> None:
    tid = make_transfer_id("evil\nline " + "x" * 500)
    prefix, _, rand = tid.rpartition(".")
    assert prefix == ("evil_line_" + "x" * 500)[:96]
    assert len(rand) == 16 and "\n" not in tid


def test_prefill_aborted_request_is_not_held(layout) -> None:
    side = _side(layout)
    req = make_request("r", 8, PrefillRequestParams("gw-1").to_dict())
    _finish(req, "FINISHED_ABORTED")
    assert side.request_finished(req, [1, 2]) == (False, None)
    assert side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).is_empty()


def test_plain_request_is_untouched(layout) -> None:
    side = _side(layout)
    req = make_request("r", 8)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    _finish(req, "FINISHED_STOPPED")
    assert side.request_finished(req, [1, 2]) == (False, None)


def test_decode_pulls_exactly_the_prompt_blocks_into_allocated_blocks(layout) -> None:
    side = _side(layout)
    req = make_request("d1", 10, _decode_params(layout, 10))
    assert side.get_num_new_matched_tokens(req, 0) == (10, True)
    # calling again (vLLM may) gives the same answer and has no side effect
    assert side.get_num_new_matched_tokens(req, 0) == (10, True)
    side.update_state_after_alloc(req, make_blocks([40, 12, 33]), 10)
    meta = side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    (load,) = meta.loads
    assert load.transfer_id == "gw-1.abcd" and load.endpoint == "127.0.0.1:50100"
    assert load.remote_block_indices == (0, 1, 2)
    assert load.local_block_ids == (40, 12, 33)  # by position, not sorted
    # second call after the load (num_external_tokens=0) starts nothing new
    side.update_state_after_alloc(req, make_blocks([40, 12, 33]), 0)
    assert side.get_num_new_matched_tokens(req, 10) == (0, False)
    assert side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).is_empty()


def test_decode_with_local_prefix_hit_pulls_only_the_rest(layout) -> None:
    side = _side(layout)
    req = make_request("d2", 10, _decode_params(layout, 10))
    assert side.get_num_new_matched_tokens(req, 4) == (6, True)
    side.update_state_after_alloc(req, make_blocks([5, 6, 7]), 6)
    (load,) = side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).loads
    assert load.remote_block_indices == (1, 2) and load.local_block_ids == (6, 7)


def test_decode_with_full_local_hit_releases_the_transfer(layout) -> None:
    side = _side(layout)
    req = make_request("d3", 8, _decode_params(layout, 8))
    assert side.get_num_new_matched_tokens(req, 8) == (0, False)
    side.update_state_after_alloc(req, make_blocks([1, 2]), 0)
    meta = side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert not meta.loads
    assert [(r.transfer_id, r.endpoint) for r in meta.releases] == [
        ("gw-1.abcd", "127.0.0.1:50100")
    ]


def test_decode_refuses_a_different_layout_and_computes_locally(layout) -> None:
    side = _side(layout)
    req = make_request("d4", 8, _decode_params(layout, 8, kv_layout="L9.H9.D9.B9.bfloat16"))
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, make_blocks([1, 2]), 0)
    meta = side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    assert not meta.loads and len(meta.releases) == 1


def test_decode_refuses_a_prompt_length_mismatch(layout) -> None:
    side = _side(layout)
    for i, length in enumerate((7, 10, 12)):  # shorter, or more than one token longer
        req = make_request(f"d5-{i}", length, _decode_params(layout, 8))
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)


def test_decode_prompt_one_token_longer_loads_prefills_tokens_and_computes_the_last(
    layout,
) -> None:
    # The gateway streamed prefill's first output token and appended it to decode's prompt.
    side = _side(layout)
    computed = list(range(10, 18))  # make_request's first 8 prompt ids
    req = make_request("d6", 9, _decode_params(layout, 8, prompt_hash=prompt_fingerprint(computed)))
    assert side.get_num_new_matched_tokens(req, 0) == (8, True)
    side.update_state_after_alloc(req, make_blocks([40, 12, 33]), 8)
    (load,) = side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).loads
    assert load.remote_block_indices == (0, 1) and load.local_block_ids == (40, 12)
    assert load.num_tokens == 8
    # the fingerprint covers prefill's tokens only: another prompt of that length is refused
    other = prompt_fingerprint(list(range(500, 508)))
    wrong = make_request("d7", 9, _decode_params(layout, 8, prompt_hash=other))
    assert side.get_num_new_matched_tokens(wrong, 0) == (0, False)


def test_prefill_fingerprints_the_prompt_it_computed(layout) -> None:
    side = _side(layout)
    req = make_request("p1", 10, PrefillRequestParams("gw-1").to_dict())
    _finish(req, "FINISHED_LENGTH_CAPPED")
    _, params = side.request_finished(req, [7, 3, 9])
    assert DecodeRequestParams.from_dict(params).prompt_hash == prompt_fingerprint(
        req.prompt_token_ids
    )


def test_decode_refuses_kv_of_another_prompt_of_the_same_length(layout) -> None:
    # e.g. a batched prompt whose engine requests all carry one kv_transfer_params
    side = _side(layout)
    other = prompt_fingerprint(list(range(500, 508)))
    req = make_request("d8", 8, _decode_params(layout, 8, prompt_hash=other))
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    same = make_request(
        "d9", 8, _decode_params(layout, 8, prompt_hash=prompt_fingerprint(list(range(10, 18))))
    )
    assert side.get_num_new_matched_tokens(same, 0) == (8, True)


def test_decode_request_ended_before_its_load_releases_prefill(layout) -> None:
    side = _side(layout)
    req = make_request("d6", 8, _decode_params(layout, 8))
    side.get_num_new_matched_tokens(req, 0)
    _finish(req, "FINISHED_ABORTED")
    assert side.request_finished(req, []) == (False, None)
    (release,) = side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).releases
    assert release.transfer_id == "gw-1.abcd"


def test_malformed_decode_params_are_ignored(layout) -> None:
    side = _side(layout)
    req = make_request("d7", 8, {"do_remote_prefill": True, "remote_block_ids": "nope"})
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)


def test_load_report_counts_requests_and_transfers(layout) -> None:
    side = _side(layout)
    for i in range(3):
        side.on_new_request(make_request(f"q{i}", 4))
    side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"q0": 4}))
    held = make_request("p", 4, PrefillRequestParams("gw").to_dict())
    _finish(held, "FINISHED_LENGTH_CAPPED")
    side.request_finished(held, [1])
    pool = SimpleNamespace(get_num_free_blocks=lambda: 50, get_usage=lambda: 0.25)
    report = side.load(SimpleNamespace(block_pool=pool), 64)
    assert (report.num_running, report.num_waiting, report.inflight_transfers) == (1, 2, 1)
    assert (report.free_kv_blocks, report.total_kv_blocks, report.kv_cache_usage) == (50, 64, 0.25)
    side.update_connector_output(SimpleNamespace(finished_sending={"p"}, finished_recving=None))
    assert side.load(None, 64).inflight_transfers == 0


def test_a_second_finished_request_never_releases_a_transfer_being_pulled(layout) -> None:
    # vLLM 0.32 finishes two Request objects with the same params when a client aborts a
    # decode waiting for its KV (its internal id and the external id).
    side = _side(layout)
    params = _decode_params(layout, 8)
    pulling = make_request("cmpl-abc-0-1234", 8, params)
    side.get_num_new_matched_tokens(pulling, 0)
    side.update_state_after_alloc(pulling, make_blocks([1, 2]), 8)
    side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))
    twin = make_request("abc", 8, params)
    for req in (pulling, twin):
        _finish(req, "FINISHED_ABORTED")
        assert side.request_finished(req, []) == (False, None)
    assert side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).is_empty()
    # once the pull is reported finished, an unconsumed request releases as before
    side.update_connector_output(
        SimpleNamespace(finished_sending=None, finished_recving={"cmpl-abc-0-1234"})
    )
    late = make_request("late", 8, params)
    _finish(late, "FINISHED_ABORTED")
    side.request_finished(late, [])
    assert len(side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).releases) == 1
