"""Must show: the exact prefill and decode bodies the instances received."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from pdplane.core.kv_params import DecodeRequestParams, PrefillRequestParams
from pdplane.sim.testing import RunningSims, SimHandle
from tests.integration.gateway.conftest import MODEL, Stack

_MESSAGES = [{"role": "user", "content": "Tell me about paged attention."}]

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat_max_completion_tokens_only": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": _MESSAGES, "max_completion_tokens": 256},
    ),
    "chat_both_limits": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": _MESSAGES, "max_tokens": 64, "max_completion_tokens": 32},
    ),
    "chat_neither_limit": ("/v1/chat/completions", {"model": MODEL, "messages": _MESSAGES}),
    "chat_min_tokens": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": _MESSAGES, "min_tokens": 5, "max_tokens": 100},
    ),
    "completions_min_tokens": (
        "/v1/completions",
        {"model": MODEL, "prompt": "Paged attention is", "min_tokens": 5, "max_tokens": 100},
    ),
}


def _expected_prefill(
    path: str, body: dict[str, Any], prefill: dict[str, Any], decode: SimHandle
) -> dict[str, Any]:
    """The prefill body the gateway should have sent for the client's `body`, as `prefill`
    (the prefill sim's record of it) received it."""
    expected = {k: v for k, v in body.items() if k not in ("min_tokens", "stream_options")}
    expected.update(max_tokens=1, stream=False, n=1)
    if path == "/v1/chat/completions":
        expected["max_completion_tokens"] = 1
    # The gateway chose the transfer id prefill holds the KV under: `<request id>.<16 hex>`.
    request_id = prefill["request_id"]
    transfer_id = prefill["body"]["kv_transfer_params"]["pdplane_transfer_id"]
    head, _, tail = transfer_id.rpartition(".")
    assert head == request_id and len(tail) == 16 and int(tail, 16) >= 0, transfer_id
    assert prefill["kv"]["transfer_id"] == transfer_id
    # The scheduled decode is named too (a push-mode prefill sends the KV there).
    params = PrefillRequestParams(request_id, decode.instance_id, decode.kv_endpoint, transfer_id)
    expected["kv_transfer_params"] = params.to_dict()
    return expected


def _vllm_accepts(path: str, body: dict[str, Any]) -> None:
    """Validates `body` with vLLM 0.32's own request model and sampling-parameter checks."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    model = ChatCompletionRequest if path == "/v1/chat/completions" else CompletionRequest
    request = model.model_validate(body)
    request.to_sampling_params(body["max_tokens"], {})


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_and_decode_receive_the_contract_bodies(
    pair: tuple[Stack, RunningSims], case: str
) -> None:
    stack, sims = pair
    path, body = CASES[case]
    request_id = f"bodies-{case}"
    r = httpx.post(stack.url + path, json=body, headers={"X-Request-Id": request_id}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == request_id

    [prefill] = sims[0].records()
    [decode] = sims[1].records()
    # Upstream gets the gateway's unique id, the client's id first (for the instances' logs).
    sent = prefill["request_id"]
    assert decode["request_id"] == sent and sent.startswith(f"{request_id}-pdp-")
    assert prefill["body"] == _expected_prefill(path, body, prefill, sims[1])
    returned = decode["body"]["kv_transfer_params"]
    assert decode["body"] == {**body, "kv_transfer_params": returned}
    params = DecodeRequestParams.from_dict(returned)
    assert params.transfer_id == prefill["kv"]["transfer_id"]
    assert params.engine_id == sims[0].instance_id
    assert decode["kv"]["result"] == "pulled"
    _vllm_accepts(path, prefill["body"])


def test_the_vllm_check_rejects_min_tokens_above_one() -> None:
    # Guards the check above: a prefill body that kept min_tokens=5 must fail it.
    from vllm.exceptions import VLLMValidationError

    path, body = CASES["chat_min_tokens"]
    with pytest.raises(VLLMValidationError, match="min_tokens"):
        _vllm_accepts(path, {**body, "max_tokens": 1})


@pytest.mark.parametrize("stream", [False, True])
def test_concurrent_dispatch_sends_the_same_decode_body(stack_factory, stream: bool) -> None:  # type: ignore[no-untyped-def]
    stack = stack_factory(dispatch="concurrent")
    sims = stack.sims(["prefill", "decode"], ttft_per_token_ms=5)
    stack.wait_ready(sims)
    path, body = CASES["chat_both_limits"]
    body = {**body, "stream": stream}
    r = httpx.post(stack.url + path, json=body, headers={"X-Request-Id": "conc"}, timeout=10)
    assert r.status_code == 200, r.text
    [prefill] = sims[0].records()
    [decode] = sims[1].records()
    assert prefill["body"] == _expected_prefill(path, body, prefill, sims[1])
    returned = decode["body"]["kv_transfer_params"]
    # a stream's decode also streams its token ids (what migrating it needs)
    ids = {"return_token_ids": True} if stream else {}
    assert decode["body"] == {**body, **ids, "kv_transfer_params": returned}
    assert DecodeRequestParams.from_dict(returned).transfer_id == prefill["kv"]["transfer_id"]
    assert decode["kv"]["result"] == "pulled"
