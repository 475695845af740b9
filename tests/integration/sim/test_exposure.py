"""The sim's KvTransfer token and its /sim/* control routes (loopback only by default)."""

from __future__ import annotations

import grpc
import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from pdplane.core.grpc.util import token_metadata
from pdplane.core.kv_params import PrefillRequestParams
from pdplane.sim.app import control_guard
from pdplane.sim.testing import running_sims
from pdplane.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc


def test_kv_token_guards_the_sims_kv_transfer_and_pd_still_works() -> None:
    with running_sims(["prefill", "decode"], kv_token="s3cret") as sims:
        with grpc.insecure_channel(sims[0].kv_endpoint) as channel:
            stub = kv_transfer_pb2_grpc.KvTransferStub(channel)
            request = kv_transfer_pb2.AbortTransferRequest(transfer_id="t")
            with pytest.raises(grpc.RpcError) as err:
                stub.AbortTransfer(request, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            answer = stub.AbortTransfer(request, timeout=5, metadata=token_metadata("s3cret"))
            assert answer.freed is False
        # decode pulls from prefill with the same token
        prompt = {"model": "sim-model", "prompt": "one two three", "max_tokens": 2}
        prefill = {
            **prompt,
            "max_tokens": 1,
            "kv_transfer_params": PrefillRequestParams("r").to_dict(),
        }
        first = httpx.post(sims[0].url + "/v1/completions", json=prefill)
        assert first.status_code == 200, first.text
        params = first.json()["kv_transfer_params"]
        second = httpx.post(
            sims[1].url + "/v1/completions", json={**prompt, "kv_transfer_params": params}
        )
        assert second.status_code == 200, second.text
        assert sims[1].records()[-1]["kv"]["result"] == "pulled"


async def _call(guard: object, remote: str, path: str) -> int:
    async def handler(_request: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    request = make_mocked_request("GET", path, transport=_Transport(remote))
    response = await guard(request, handler)  # type: ignore[operator]
    return response.status


class _Transport:
    def __init__(self, remote: str) -> None:
        self._remote = remote

    def get_extra_info(self, name: str, default: object = None) -> object:
        return (self._remote, 1234) if name == "peername" else default

    def is_closing(self) -> bool:
        return False


async def test_control_routes_answer_loopback_clients_only_unless_opened() -> None:
    closed, opened = control_guard(open_control=False), control_guard(open_control=True)
    assert await _call(closed, "127.0.0.1", "/sim/faults") == 200
    assert await _call(closed, "::1", "/sim/transfers") == 200
    assert await _call(closed, "10.1.2.3", "/sim/faults") == 403
    assert await _call(closed, "10.1.2.3", "/v1/models") == 200  # OpenAI routes stay open
    assert await _call(opened, "10.1.2.3", "/sim/faults") == 200
