"""kv_transfer_params in and out like the pdplane connector, and the KvTransfer peer control."""

from __future__ import annotations

import grpc
import httpx
import pytest

from pdplane.core.kv_params import DecodeRequestParams, PrefillRequestParams, make_transfer_id
from pdplane.sim.testing import running_sims
from pdplane.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc, kv_transfer_tcp_pb2_grpc
from tests.integration.sim.helpers import wait_for

PROMPT = {"model": "sim-model", "prompt": "one two three four five six seven", "max_tokens": 6}


def _prefill(url: str, request_id: str = "req-1") -> dict:
    body = {
        **PROMPT,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": PrefillRequestParams(request_id).to_dict(),
    }
    r = httpx.post(url + "/v1/completions", json=body, headers={"X-Request-Id": request_id})
    assert r.status_code == 200, r.text
    return r.json()


def test_prefill_returns_decode_params_and_decode_pulls_them() -> None:
    with running_sims(["prefill", "decode", "both"], block_size=4) as sims:
        p, d, single = sims
        first = _prefill(p.url)
        params = DecodeRequestParams.from_dict(first["kv_transfer_params"])
        assert params.request_id == "req-1"
        assert params.engine_id == p.instance_id and params.kv_endpoint == p.kv_endpoint
        assert params.num_tokens == 7 and len(params.block_ids) == 2  # 7 tokens, 4 per block
        assert p.held_transfers() == [params.transfer_id]

        body = {**PROMPT, "kv_transfer_params": first["kv_transfer_params"]}
        out = httpx.post(d.url + "/v1/completions", json=body).json()
        direct = httpx.post(single.url + "/v1/completions", json=PROMPT).json()
        assert out["choices"][0]["text"] == direct["choices"][0]["text"]
        assert out["choices"][0]["text"].startswith(first["choices"][0]["text"])
        assert d.records()[0]["kv"] == {
            "role": "consumer",
            "transfer_id": params.transfer_id,
            "result": "pulled",
        }
        assert p.held_transfers() == []
        assert p.freed_transfers()[0]["reason"] == "completed"
        state = httpx.get(p.url + "/sim/state").json()["load"]
        assert state["free_kv_blocks"] == state["total_kv_blocks"]
        metrics = httpx.get(d.url + "/metrics").text
        assert 'vllm:external_prefix_cache_hits_total{engine="0",model_name="sim-model"} 7.0' in (
            metrics
        )


def test_abort_frees_blocks_and_a_later_pull_fails_per_policy() -> None:
    with running_sims(["prefill", "decode"], kv_load_failure_policy="fail") as sims:
        p, d = sims
        kv = _prefill(p.url)["kv_transfer_params"]
        with grpc.insecure_channel(p.kv_endpoint) as channel:
            stub = kv_transfer_pb2_grpc.KvTransferStub(channel)
            request = kv_transfer_pb2.AbortTransferRequest(
                transfer_id=kv["pdplane_transfer_id"], reason="client disconnected"
            )
            assert stub.AbortTransfer(request, timeout=5).freed
            assert not stub.AbortTransfer(request, timeout=5).freed
        assert p.freed_transfers()[0]["reason"] == "aborted: client disconnected"
        r = httpx.post(d.url + "/v1/completions", json={**PROMPT, "kv_transfer_params": kv})
        assert r.status_code == 500 and "KV load failed" in r.json()["error"]["message"]


def _abort(kv_endpoint: str, transfer_id: str) -> bool:
    with grpc.insecure_channel(kv_endpoint) as channel:
        stub = kv_transfer_pb2_grpc.KvTransferStub(channel)
        request = kv_transfer_pb2.AbortTransferRequest(transfer_id=transfer_id, reason="gone")
        return bool(stub.AbortTransfer(request, timeout=5).freed)


def test_prefill_holds_under_the_transfer_id_the_gateway_chose() -> None:
    with running_sims(["prefill"]) as sims:
        (p,) = sims
        chosen = make_transfer_id("req-1")
        params = PrefillRequestParams("req-1", transfer_id=chosen).to_dict()
        r = httpx.post(
            p.url + "/v1/completions",
            json={**PROMPT, "max_tokens": 1, "kv_transfer_params": params},
        )
        assert r.json()["kv_transfer_params"]["pdplane_transfer_id"] == chosen
        assert p.held_transfers() == [chosen]


def test_an_abort_before_the_hold_ends_it_as_soon_as_it_starts() -> None:
    # The gateway gave up on prefill's answer (its client left) before prefill held the KV.
    with running_sims(["prefill"]) as sims:
        (p,) = sims
        chosen = make_transfer_id("req-1")
        assert not _abort(p.kv_endpoint, chosen)
        params = PrefillRequestParams("req-1", transfer_id=chosen).to_dict()
        body = {**PROMPT, "max_tokens": 1, "kv_transfer_params": params}
        assert httpx.post(p.url + "/v1/completions", json=body).status_code == 200
        assert p.held_transfers() == []
        [freed] = p.freed_transfers()
        assert freed["transfer_id"] == chosen and freed["reason"].startswith("aborted: gone")
        state = httpx.get(p.url + "/sim/state").json()["load"]
        assert state["free_kv_blocks"] == state["total_kv_blocks"]


def test_a_client_leaving_after_prefill_finished_leaves_the_kv_held() -> None:
    # As vLLM: the engine finished the request, so the disconnect aborts nothing; the KV waits
    # for AbortTransfer (or the hold timeout).
    with running_sims(["prefill"]) as sims:
        (p,) = sims
        p.set_faults(fail_request_prefix="late-", fail_mode="stall")  # held, then no answer
        chosen = make_transfer_id("late-1")
        params = PrefillRequestParams("late-1", transfer_id=chosen).to_dict()
        body = {**PROMPT, "max_tokens": 1, "kv_transfer_params": params}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                p.url + "/v1/completions",
                json=body,
                headers={"X-Request-Id": "late-1"},
                timeout=httpx.Timeout(5, read=0.5),
            )
        wait_for(lambda: p.records()[0]["cancelled"])  # prefill saw its client leave
        assert p.held_transfers() == [chosen]
        assert _abort(p.kv_endpoint, chosen)
        assert p.held_transfers() == []


def test_failed_pull_recomputes_by_default() -> None:
    with running_sims(["prefill", "decode"]) as sims:
        p, d = sims
        kv = _prefill(p.url)["kv_transfer_params"]
        kv["pdplane_transfer_id"] = "not-issued-by-prefill"
        r = httpx.post(d.url + "/v1/completions", json={**PROMPT, "kv_transfer_params": kv})
        assert r.status_code == 200
        assert d.records()[0]["kv"]["result"].startswith("failed: transfer unknown")
        assert len(p.held_transfers()) == 1  # the real transfer is still held


def test_layout_mismatch_is_a_load_failure_that_frees_prefill() -> None:
    with running_sims(["prefill", "decode"], kv_load_failure_policy="fail") as sims:
        p, d = sims
        kv = _prefill(p.url)["kv_transfer_params"]
        kv["pdplane_kv_layout"] = "L9.H9.D9.B9.bfloat16"
        r = httpx.post(d.url + "/v1/completions", json={**PROMPT, "kv_transfer_params": kv})
        assert r.status_code == 500
        assert p.freed_transfers()[0]["reason"] == "failed"


def test_unpulled_transfer_is_freed_after_the_hold_timeout() -> None:
    with running_sims("prefill", kv_hold_timeout_s=0.2) as sims:
        _prefill(sims[0].url)
        freed = wait_for(sims[0].freed_transfers, timeout=5)
        assert freed[0]["reason"] == "timeout" and sims[0].held_transfers() == []


def test_nixl_style_params_are_accepted() -> None:
    with running_sims(["prefill", "decode"]) as sims:
        p, d = sims
        nixl = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        body = {**PROMPT, "max_tokens": 1, "kv_transfer_params": nixl}
        out = httpx.post(
            p.url + "/v1/completions", json=body, headers={"X-Request-Id": "router-7"}
        ).json()["kv_transfer_params"]
        assert out["do_remote_prefill"] is True and out["pdplane_request_id"] == "router-7"
        assert out["remote_host"] == "127.0.0.1"
        decode_only = {
            k: out[k]
            for k in (
                "do_remote_decode",
                "do_remote_prefill",
                "remote_engine_id",
                "remote_block_ids",
                "remote_host",
                "remote_port",
            )
        }
        r = httpx.post(
            d.url + "/v1/completions", json={**PROMPT, "kv_transfer_params": decode_only}
        )
        assert r.status_code == 200 and d.records()[0]["kv"]["result"] == "nixl"


@pytest.mark.parametrize(
    "kv",
    [
        {"do_remote_prefill": True, "pdplane_version": 1},
        {"do_remote_prefill": True, "pdplane_version": 99},
        {"do_remote_prefill": True, "remote_block_ids": "x", "remote_engine_id": "e"},
    ],
)
def test_invalid_decode_params_are_400(kv: dict) -> None:
    with running_sims("decode") as sims:
        r = httpx.post(sims.urls[0] + "/v1/completions", json={**PROMPT, "kv_transfer_params": kv})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "kv_transfer_params"


def test_data_rpcs_answer_unimplemented_with_a_reason() -> None:
    with running_sims("prefill") as sims, grpc.insecure_channel(sims[0].kv_endpoint) as channel:
        stub = kv_transfer_tcp_pb2_grpc.TcpKvTransferStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.PullBlocks(kv_transfer_pb2.PullBlocksRequest(transfer_id="x"), timeout=5))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "no KV bytes" in (err.value.details() or "")
