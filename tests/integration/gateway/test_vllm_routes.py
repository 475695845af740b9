"""The gateway answers like `vllm serve` beyond the two generation endpoints: a request without
`model` is for the default model, empty prompts get vLLM's own error text, and vLLM's
read-only routes (/tokenize, /version, /ping, the /v1/models details) are answered by an
instance of the model (the sims answer these like vLLM)."""

from __future__ import annotations

import httpx

from pdplane.sim.testing import running_sims
from tests.integration.gateway.conftest import MODEL, Stack, wait_for


def _post(stack: Stack, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{stack.url}{path}", json=body, timeout=10)


def test_a_request_without_model_is_served_by_the_default_model(stack: Stack) -> None:
    sims = stack.sims(["prefill", "decode"])
    stack.wait_ready(sims)
    r = _post(stack, "/v1/completions", {"prompt": "hello there", "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL
    r = _post(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text


def test_without_model_and_several_models_the_request_must_name_one(stack: Stack) -> None:
    sims = stack.sims(["prefill", "decode"])
    stack.wait_ready(sims)
    with running_sims(["prefill", "decode"], registry=stack.registry, model="other"):
        wait_for(lambda: len(httpx.get(f"{stack.url}/v1/models").json()["data"]) == 2)
        r = _post(stack, "/v1/completions", {"prompt": "hello", "max_tokens": 3})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "model"
    assert f"(other, {MODEL})" in r.json()["error"]["message"]


def test_empty_prompts_get_vllm_s_error_text(stack: Stack) -> None:
    sims = stack.sims(["prefill", "decode"])
    stack.wait_ready(sims)
    for body in ({"model": MODEL, "prompt": ""}, {"model": MODEL}, {"prompt": []}):
        r = _post(stack, "/v1/completions", body)
        assert r.status_code == 400
        assert r.json()["error"] == {
            "message": "Either prompt or prompt_embeds must be provided and non-empty. "
            "(parameter=prompt)",
            "type": "BadRequestError",
            "param": "prompt",
            "code": 400,
        }
    r = _post(stack, "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "Cannot apply chat template to an empty conversation. Provide at least one message."
    )
    assert all(h.records() == [] for h in sims.handles)  # refused before any instance


def test_read_only_vllm_routes_are_answered_by_an_instance(stack: Stack) -> None:
    sims = stack.sims(["prefill", "decode"])
    stack.wait_ready(sims)
    direct = httpx.post(f"{sims.handles[0].url}/tokenize", json={"prompt": "a b c"}).json()
    r = _post(stack, "/tokenize", {"model": MODEL, "prompt": "a b c"})
    assert r.status_code == 200 and r.json() == direct
    assert _post(stack, "/tokenize", {"prompt": "a b c"}).json() == direct  # default model
    assert _post(stack, "/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404
    version = httpx.get(f"{stack.url}/version")
    assert version.status_code == 200
    assert version.json() == httpx.get(f"{sims.handles[0].url}/version").json()
    assert httpx.get(f"{stack.url}/ping").status_code == 200
    assert httpx.post(f"{stack.url}/ping").status_code == 200
    (entry,) = httpx.get(f"{stack.url}/v1/models").json()["data"]
    assert entry["id"] == MODEL
    assert entry["owned_by"] == "vllm" and "permission" in entry  # the instance's details


def test_tokenize_takes_the_model_root_as_its_name(stack: Stack) -> None:
    # `vllm bench serve` without --model sends /v1/models' `root` as the model of /tokenize.
    sims = stack.sims(["prefill", "decode"], model_root="/models/tiny-weights")
    stack.wait_ready(sims)
    (entry,) = httpx.get(f"{stack.url}/v1/models").json()["data"]
    assert (entry["id"], entry["root"]) == (MODEL, "/models/tiny-weights")
    direct = httpx.post(f"{sims.handles[0].url}/tokenize", json={"prompt": "a b"}).json()
    r = _post(stack, "/tokenize", {"model": "/models/tiny-weights", "prompt": "a b"})
    assert r.status_code == 200, r.text
    assert r.json() == direct
    assert _post(stack, "/tokenize", {"model": "/models/other", "prompt": "a"}).status_code == 404


def test_ping_is_503_without_a_usable_pair(stack: Stack) -> None:
    stack.sims(["decode"])
    wait_for(lambda: httpx.get(f"{stack.url}/v1/models").json()["data"] != [])
    assert httpx.get(f"{stack.url}/ping").status_code == 503
