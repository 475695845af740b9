"""Must show: KV-aware routing with no tokenizer flag, from the tokenizer the instances publish.

Registry, scheduler (kv_aware, prefix index from the sims' KV events) and a gateway started
without `--tokenizer`, in front of sims started with the tiny model's tokenizer (they publish it
as the connector does). A long shared prefix, as text and as chat, lands on the instance that
holds it, and the sim's own `vllm:prefix_cache_hits` grows by what the scheduler predicted;
token-id prompts do the same with no tokenizer anywhere. A model whose instances publish
different tokenizers routes by load, says why in /health, in one log line and in
`pdplane_gateway_routing_precise`, and becomes precise again once they agree.
"""

from __future__ import annotations

import io
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdplane.cli import status
from pdplane.core.prefix_hash import block_hashes
from pdplane.gateway.prompt_ids import PromptTokenizer
from pdplane.sim.testing import RunningSims, running_sims
from tests.integration.gateway.conftest import MODEL, Stack, wait_for

BS = 16  # the sims' KV cache block size


def _routing(stack: Stack) -> dict[str, Any]:
    entry: dict[str, Any] = stack.health().json()["models"].get(MODEL, {})
    return entry


def _gauge(stack: Stack, name: str, **labels: str) -> float | None:
    text = httpx.get(f"{stack.url}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def _sim_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "vllm:prefix_cache_hits_total"
    )


def _route(headers: httpx.Headers, side: str) -> tuple[str, int]:
    """(instance id, predicted cached tokens) of the X-Pdplane-Prefill / -Decode header."""
    value = headers[f"x-pdplane-{side}"]
    instance, _, cached = value.partition("; cached_tokens=")
    return instance, int(cached or 0)


def _post(stack: Stack, path: str, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(
        f"{stack.url}{path}",
        json={"model": MODEL, "max_tokens": 4, **body},
        headers={"X-Pdplane-Route": "1"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r


def _settle(stack: Stack, ids: list[int], instance: str) -> None:
    """Waits until the prefix index holds every full block of `ids` on `instance` (what the
    next request's routing is asserted on; the sim publishes from its own loop)."""
    hashes = block_hashes(ids, BS)
    index = stack.kv_index().index
    wait_for(
        lambda: index.match(hashes, instances=[instance]).get(instance, 0) >= len(hashes),
        10,
        f"the index to hold {len(hashes)} blocks on {instance}",
    )


@pytest.fixture
def fleet(
    stack_factory: Callable[..., Stack], tiny_model: Path, tmp_path: Path
) -> tuple[Stack, RunningSims]:
    stack = stack_factory(tokenizer_cache_dir=str(tmp_path / "tokenizers"))
    sims = stack.sims(
        ["prefill", "prefill", "decode", "decode"], tokenizer=str(tiny_model), itl_ms=1
    )
    stack.wait_ready(sims)
    wait_for(lambda: _routing(stack).get("routing") == "precise", 30, "precise routing")
    return stack, sims


def test_health_and_the_gauge_say_routing_is_precise_and_why(
    fleet: tuple[Stack, RunningSims],
) -> None:
    stack, sims = fleet
    entry = _routing(stack)
    assert entry["tokenizer"].startswith("sha256:")
    assert entry["routing_reason"].startswith("tokenizer published by ")
    assert _gauge(stack, "pdplane_gateway_routing_precise", model=MODEL) == 1.0
    assert sorted(h.instance_id for h in sims.handles)[0] in entry["routing_reason"]
    # `pdplane status` shows the same, one line per model.
    out = io.StringIO()
    assert status.main(["--gateway", stack.url], out=out) == 0
    line = next(li for li in out.getvalue().splitlines() if li.startswith(MODEL))
    assert line.split()[1:5] == ["2", "2", "yes", "precise"], line
    assert "tokenizer published by" in line


def test_each_model_gets_its_own_tokenizer(
    stack_factory: Callable[..., Stack], tiny_model: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    (other / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    stack = stack_factory(tokenizer_cache_dir=str(tmp_path / "tokenizers"))
    a = stack.sims(["prefill", "decode"], tokenizer=str(tiny_model), itl_ms=1)
    with running_sims(
        ["prefill", "decode"], registry=stack.registry, model="second", tokenizer=str(other)
    ):
        stack.wait_ready(a)
        _two_models_each_with_its_tokenizer(stack, tiny_model, other)


def _two_models_each_with_its_tokenizer(stack: Stack, tiny_model: Path, other: Path) -> None:

    def routing() -> dict[str, tuple[str, str]]:
        models = stack.health().json()["models"]
        return {m: (e.get("routing", ""), e.get("tokenizer", "")) for m, e in models.items()}

    wait_for(
        lambda: [r for r, _ in routing().values()] == ["precise", "precise"],
        30,
        "both models routed precisely",
    )
    hashes = {model: h for model, (_, h) in routing().items()}
    assert hashes[MODEL] != hashes["second"] and len(hashes) == 2
    chat = {"messages": [{"role": "user", "content": "hi there"}]}
    ids = {
        model: _post(stack, "/v1/chat/completions", {**chat, "model": model}).headers[
            "x-pdplane-prompt-tokens"
        ]
        for model in (MODEL, "second")
    }
    own = {
        MODEL: PromptTokenizer(tiny_model).chat_ids(chat, 0),
        "second": PromptTokenizer(other).chat_ids(chat, 0),
    }
    assert ids == {m: f"{len(v or [])}; exact" for m, v in own.items()}
    assert len(own[MODEL] or []) != len(own["second"] or [])


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_a_shared_prefix_lands_on_its_holder_with_no_tokenizer_flag(
    fleet: tuple[Stack, RunningSims], tiny_model: Path, kind: str
) -> None:
    stack, sims = fleet
    tok = PromptTokenizer(tiny_model)
    shared = " ".join(f"tenant rule {i}: answer in kind." for i in range(60))

    def body(suffix: str) -> tuple[str, dict[str, Any]]:
        # Suffixes longer than --local-prefill-max-tokens: the prefill choice is tested.
        tail = " ".join(f"question {suffix} part {i}" for i in range(80))
        if kind == "text":
            return "/v1/completions", {"prompt": f"{shared} {tail}"}
        return "/v1/chat/completions", {
            "messages": [{"role": "system", "content": shared}, {"role": "user", "content": tail}]
        }

    def ids(b: dict[str, Any]) -> list[int]:
        got = tok.chat_ids(b, 0) if kind == "chat" else tok.completion_ids(b, 0)
        assert got is not None
        return got

    path, first = body("one")
    r = _post(stack, path, first)
    holder, _ = _route(r.headers, "prefill")
    assert r.headers["x-pdplane-prompt-tokens"] == f"{len(ids(first))}; exact"
    _settle(stack, ids(first), holder)
    url = {h.instance_id: h.url for h in sims.handles}[holder]

    for suffix in ("two", "three"):
        path, nth = body(suffix)
        common = 0
        for a, b in zip(ids(first), ids(nth), strict=False):
            if a != b:
                break
            common += 1
        before = _sim_hits(url)
        r = _post(stack, path, nth)
        prefill, cached = _route(r.headers, "prefill")
        reason = r.headers["x-pdplane-route-reason"]
        assert prefill == holder, reason
        assert cached == common // BS * BS > 0, (cached, common, reason)
        assert f"cached={cached}/" in reason, reason
        assert _sim_hits(url) - before == cached  # the engine reused what was predicted
        _settle(stack, ids(nth), holder)


def test_token_id_prompts_route_by_prefix_with_no_tokenizer_anywhere(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory()
    sims = stack.sims(["prefill", "prefill", "decode", "decode"], itl_ms=1)  # word tokenizer
    stack.wait_ready(sims)
    wait_for(lambda: _routing(stack).get("routing") == "load", 10, "the routing state")
    shared = [(i * 7919) % 1900 + 10 for i in range(40 * BS)]
    first = shared + list(range(500, 800))
    r = _post(stack, "/v1/completions", {"prompt": first})
    holder, _ = _route(r.headers, "prefill")
    assert r.headers["x-pdplane-prompt-tokens"] == f"{len(first)}; exact"
    _settle(stack, first, holder)
    for n in range(2):
        r = _post(stack, "/v1/completions", {"prompt": shared + list(range(900 + n, 1200 + n))})
        prefill, cached = _route(r.headers, "prefill")
        assert (prefill, cached) == (holder, len(shared)), r.headers["x-pdplane-route-reason"]


def test_instances_that_disagree_route_by_load_until_they_agree(
    stack_factory: Callable[..., Stack],
    tiny_model: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    other = tmp_path / "other-template"
    shutil.copytree(tiny_model, other)
    template = other / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|assistant|>", "<|bot|>"))
    stack = stack_factory(tokenizer_cache_dir=str(tmp_path / "tokenizers"))
    sims = stack.sims(["prefill", "decode"], tokenizer=str(tiny_model), itl_ms=1)
    stack.wait_ready(sims)
    wait_for(lambda: _routing(stack).get("routing") == "precise", 30, "precise routing")

    with (
        caplog.at_level(logging.WARNING, "pdplane.gateway.fleet_tokenizers"),
        running_sims(
            ["decode"], registry=stack.registry, model=MODEL, tokenizer=str(other), itl_ms=1
        ) as odd,
    ):
        wait_for(lambda: _routing(stack).get("routing") == "load", 10, "routing by load")
        entry = _routing(stack)
        assert entry["routing_reason"].startswith("its instances publish different tokenizers")
        assert odd[0].instance_id in entry["routing_reason"]
        assert _gauge(stack, "pdplane_gateway_routing_precise", model=MODEL) == 0.0
        # Requests still flow, by load, with estimated lengths.
        r = _post(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert r.headers["x-pdplane-prompt-tokens"].endswith("; estimated")
        lines = [r for r in caplog.records if "publish different tokenizers" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]
    # The odd instance left (deregistered): its instances agree again.
    wait_for(lambda: _routing(stack).get("routing") == "precise", 10, "precise routing again")
    assert _gauge(stack, "pdplane_gateway_routing_precise", model=MODEL) == 1.0
