"""`return_token_ids` in vLLM 0.32's shapes, and a decode whose prompt is prefill's + 1 token.

The second half is the gateway's "first token from prefill" flow driven by hand: prefill
returns its prompt ids and its one output token id; decode gets those ids plus that token as
its prompt, loads the KV prefill computed and computes only the extra token itself.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from pdplane.core.kv_params import DecodeRequestParams, PrefillRequestParams
from pdplane.sim.testing import running_sims

PROMPT = "one two three four five six seven"
COMPLETION = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4}
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "Hello there"}]}


def _chunks(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        frames = r.read().decode()[:-2].split("\n\n")
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[len("data: ") :]) for f in frames[:-1]]


def _tokenize(base: str, **body: Any) -> list[int]:
    ids: list[int] = httpx.post(base + "/tokenize", json=body).json()["tokens"]
    return ids


def test_completions_return_prompt_and_output_ids_on_the_choice() -> None:
    with running_sims("both") as sims:
        base = sims.urls[0]
        plain = httpx.post(base + "/v1/completions", json=COMPLETION).json()
        assert plain["choices"][0]["token_ids"] is None
        assert plain["choices"][0]["prompt_token_ids"] is None

        out = httpx.post(
            base + "/v1/completions", json={**COMPLETION, "return_token_ids": True}
        ).json()
        choice = out["choices"][0]
        assert choice["prompt_token_ids"] == _tokenize(base, prompt=PROMPT)
        assert len(choice["token_ids"]) == 4
        # The ids are those of the text returned: it tokenizes back to them.
        assert _tokenize(base, prompt=choice["text"]) == choice["token_ids"]
        assert choice["text"] == plain["choices"][0]["text"]
        assert out["prompt_token_ids"] is None  # vLLM has it on the choice for completions

        chunks = _chunks(base + "/v1/completions", {**COMPLETION, "return_token_ids": True})
        choices = [c["choices"][0] for c in chunks]
        assert choices[0]["prompt_token_ids"] == choice["prompt_token_ids"]
        assert [c["prompt_token_ids"] for c in choices[1:]] == [None] * 3
        assert [c["token_ids"] for c in choices] == [[i] for i in choice["token_ids"]]
        assert "".join(c["text"] for c in choices) == choice["text"]
        assert all(c["stop_reason"] is None for c in choices)

        plain_chunks = _chunks(base + "/v1/completions", COMPLETION)
        assert all("token_ids" not in c["choices"][0] for c in plain_chunks)  # as before


def test_echo_with_token_ids_leaves_the_prompt_text_out_like_vllm() -> None:
    with running_sims("both") as sims:
        body = {**COMPLETION, "echo": True, "return_token_ids": True}
        out = httpx.post(sims.urls[0] + "/v1/completions", json=body).json()
        choice = out["choices"][0]
        assert not choice["text"].startswith(PROMPT)
        assert len(choice["token_ids"]) == 4
        assert choice["prompt_token_ids"] == _tokenize(sims.urls[0], prompt=PROMPT)


def test_chat_returns_prompt_ids_at_the_top_and_output_ids_on_the_choice() -> None:
    with running_sims("both") as sims:
        base = sims.urls[0]
        body = {**CHAT, "max_tokens": 3, "return_token_ids": True}
        out = httpx.post(base + "/v1/chat/completions", json=body).json()
        prompt_ids = _tokenize(base, messages=CHAT["messages"])
        assert out["prompt_token_ids"] == prompt_ids
        choice = out["choices"][0]
        assert len(choice["token_ids"]) == 3
        assert _tokenize(base, prompt=choice["message"]["content"]) == choice["token_ids"]

        chunks = _chunks(base + "/v1/chat/completions", body)
        assert chunks[0]["prompt_token_ids"] == prompt_ids  # the role chunk
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all("prompt_token_ids" not in c for c in chunks[1:])
        assert [c["choices"][0]["token_ids"] for c in chunks[1:]] == [
            [i] for i in choice["token_ids"]
        ]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"

        plain = httpx.post(base + "/v1/chat/completions", json={**CHAT, "max_tokens": 3})
        assert plain.json()["prompt_token_ids"] is None
        assert plain.json()["choices"][0]["token_ids"] is None


def test_a_text_prompt_and_its_token_ids_get_the_same_answer() -> None:
    with running_sims("both") as sims:
        base = sims.urls[0]
        ids = _tokenize(base, prompt=PROMPT)
        by_text = httpx.post(base + "/v1/completions", json=COMPLETION).json()
        by_ids = httpx.post(base + "/v1/completions", json={**COMPLETION, "prompt": ids}).json()
        assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]


def test_non_boolean_return_token_ids_is_400() -> None:
    with running_sims("both") as sims:
        body = {**COMPLETION, "return_token_ids": "yes"}
        r = httpx.post(sims.urls[0] + "/v1/completions", json=body)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "return_token_ids"


def _prefill(url: str, request_id: str, **extra: Any) -> dict[str, Any]:
    body = {
        **COMPLETION,
        "max_tokens": 1,
        "kv_transfer_params": PrefillRequestParams(request_id).to_dict(),
        **extra,
    }
    r = httpx.post(url + "/v1/completions", json=body, headers={"X-Request-Id": request_id})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _free_blocks(url: str) -> tuple[int, int]:
    load = httpx.get(url + "/sim/state").json()["load"]
    return load["free_kv_blocks"], load["total_kv_blocks"]


def test_decode_of_prompt_plus_first_token_loads_prefill_kv_and_computes_one_token() -> None:
    with running_sims(["prefill", "decode", "both"], block_size=4) as sims:
        p, d, single = sims
        prefill = _prefill(p.url, "req-1", return_token_ids=True)
        kv = prefill["kv_transfer_params"]
        params = DecodeRequestParams.from_dict(kv)
        prompt_ids = prefill["choices"][0]["prompt_token_ids"]
        first = prefill["choices"][0]["token_ids"]
        assert params.num_tokens == len(prompt_ids) == 7 and len(first) == 1
        before = httpx.get(d.url + "/sim/stats").json()

        body = {
            "model": "sim-model",
            "prompt": prompt_ids + first,
            "max_tokens": 5,
            "kv_transfer_params": kv,
        }
        chunks = _chunks(d.url + "/v1/completions", body)
        assert len(chunks) == 5 and chunks[-1]["choices"][0]["finish_reason"] == "length"
        # Prefill's token + decode's 5 are the answer one instance gives to the same prompt.
        direct = httpx.post(single.url + "/v1/completions", json={**COMPLETION, "max_tokens": 6})
        text = prefill["choices"][0]["text"] + "".join(c["choices"][0]["text"] for c in chunks)
        assert text == direct.json()["choices"][0]["text"]

        after = httpx.get(d.url + "/sim/stats").json()
        assert after["external_hits"] - before["external_hits"] == 7  # loaded, not computed
        # One step for the extra prompt token (it samples output token 2), then 4 decodes.
        assert after["computed_tokens"] - before["computed_tokens"] == 5
        assert after["recomputed_prompts"] == after["kv_load_failures"] == 0
        assert d.records()[0]["kv"]["result"] == "pulled"
        assert p.held_transfers() == []
        assert p.freed_transfers()[0]["reason"] == "completed"
        for sim in (p, d):
            free, total = _free_blocks(sim.url)
            assert free == total, sim.role


def test_chat_prefill_then_completions_decode_of_its_ids_continues_the_chat_answer() -> None:
    with running_sims(["prefill", "decode", "both"], block_size=4) as sims:
        p, d, single = sims
        chat = {
            **CHAT,
            "max_tokens": 1,
            "return_token_ids": True,
            "kv_transfer_params": PrefillRequestParams("req-3").to_dict(),
        }
        prefill = httpx.post(p.url + "/v1/chat/completions", json=chat).json()
        prompt = prefill["prompt_token_ids"] + prefill["choices"][0]["token_ids"]
        body = {"model": "sim-model", "prompt": prompt, "max_tokens": 3}
        out = httpx.post(
            d.url + "/v1/completions",
            json={**body, "kv_transfer_params": prefill["kv_transfer_params"]},
        ).json()
        direct = httpx.post(single.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 4})
        text = prefill["choices"][0]["message"]["content"] + out["choices"][0]["text"]
        assert text == direct.json()["choices"][0]["message"]["content"]
        assert d.records()[0]["kv"]["result"] == "pulled"


def test_decode_of_the_exact_prompt_still_recomputes_its_last_token() -> None:
    """Today's path (prompt == num_tokens) is unchanged: the last prompt token is computed."""
    with running_sims(["prefill", "decode"], block_size=4) as sims:
        p, d = sims
        prefill = _prefill(p.url, "req-2")
        body = {**COMPLETION, "max_tokens": 5, "kv_transfer_params": prefill["kv_transfer_params"]}
        out = httpx.post(d.url + "/v1/completions", json=body).json()
        assert out["usage"]["completion_tokens"] == 5
        stats = httpx.get(d.url + "/sim/stats").json()
        assert stats["external_hits"] == 7 and stats["computed_tokens"] == 5
        assert _free_blocks(d.url)[0] == _free_blocks(d.url)[1]
