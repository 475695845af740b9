"""Must show: /v1/models and /health with 0, 1 and 2 instances; unknown model -> 404."""

from __future__ import annotations

import httpx

from pdplane.core.server_id import server_id
from tests.integration.gateway.conftest import MODEL, Stack, wait_for


def _models(stack: Stack) -> list[str]:
    r = httpx.get(f"{stack.url}/v1/models", timeout=5)
    assert r.status_code == 200
    assert r.json()["object"] == "list"
    return [m["id"] for m in r.json()["data"]]


def test_models_and_health_with_zero_one_and_two_instances(stack: Stack) -> None:
    assert _models(stack) == []
    r = stack.health()
    assert r.status_code == 503 and r.json()["reason"] == "no instances registered"

    stack.sims(["decode"])
    wait_for(lambda: _models(stack) == [MODEL], what="the decode sim in /v1/models")
    r = stack.health()
    assert r.status_code == 503
    assert r.json()["reason"] == f"model '{MODEL}': no prefill instance"
    entry = r.json()["models"][MODEL]
    assert {k: entry[k] for k in ("prefill", "decode", "paired")} == {
        "prefill": 0,
        "decode": 1,
        "paired": False,
    }

    stack.sims(["prefill"])
    wait_for(lambda: stack.health().status_code == 200, what="/health 200 with a pair")
    assert _models(stack) == [MODEL]  # deduplicated across prefill and decode
    wait_for(lambda: "routing" in stack.health().json()["models"][MODEL], what="the routing state")
    body = stack.health().json()
    assert body.pop("server_id") == server_id()  # which gateway process answered
    reason = body["models"][MODEL].pop("routing_reason")
    assert body == {
        "status": "ok",
        # Sims without --tokenizer publish none: the gateway says it routes by load.
        "models": {
            MODEL: {"prefill": 1, "decode": 1, "paired": True, "routing": "load", "tokenizer": ""}
        },
    }
    assert reason.startswith("no instance publishes its tokenizer")


def test_unknown_model_is_404_without_touching_an_instance(stack: Stack) -> None:
    sims = stack.sims(["prefill", "decode"])
    stack.wait_ready(sims)
    body = {"model": "no-such-model", "prompt": "hello", "max_tokens": 3}
    r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=5)
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": "The model `no-such-model` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    assert sims[0].records() == [] and sims[1].records() == []


def test_bad_requests_never_reach_an_instance(stack: Stack) -> None:
    sims = stack.sims(["prefill", "decode"])
    stack.wait_ready(sims)
    for raw in (b"{", b'{"model": "sim-model"}', b'{"model": 1, "prompt": "x"}'):
        r = httpx.post(f"{stack.url}/v1/completions", content=raw, timeout=5)
        assert r.status_code == 400, raw
        assert r.json()["error"]["code"] == 400
    assert sims[0].records() == [] and sims[1].records() == []
