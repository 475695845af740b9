"""Real vLLM CPU, 2 prefill + 2 decode: kv_aware routes by what the engines' caches hold.

Its own registry, scheduler (kv_aware both sides, the prefix index on, prefix warming after
two reads per holder) and gateway, plus one
plain vLLM instance for the expected greedy text. The gateway gets no tokenizer flag: it takes
the tokenizer and chat template the instances' connectors publish, so text and chat prompts
get exact ids and prefix hashes. The gateway's scheduler port records every decision, so the
tests read the `reason` and the predicted cached tokens the gateway acted on; vLLM's own
`vllm:prefix_cache_hits` says what each engine really reused.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdplane.gateway.testing import running_gateway
from pdplane.launch.ports import free_port_run
from pdplane.launch.process import http_ok, wait_until
from pdplane.launch.vllm_cpu import VllmCpuInstance, VllmCpuOptions
from pdplane.scheduler import Decision, RequestFeatures
from pdplane.scheduler.kv_index import KvState
from pdplane.scheduler.remote import RemoteScheduler
from pdplane.scheduler.server import SchedulerServer
from tests.e2e.conftest import MODEL_NAME, RegistryHandle
from tests.e2e.connector.helpers import metric
from tests.integration.scheduler.fixtures import running_scheduler_server

pytestmark = pytest.mark.vllm

BS = 128  # vLLM CPU's block size
LOCAL_PREFILL_MAX = 256
WARM_READS = 2
PREFILLS = ("kva-prefill-0", "kva-prefill-1")
DECODES = ("kva-decode-0", "kva-decode-1")


class Recording:
    """A scheduler port that remembers each (features, decision) the gateway got."""

    def __init__(self, port: RemoteScheduler) -> None:
        self.port = port
        self.decisions: list[tuple[RequestFeatures, Decision]] = []

    async def schedule(self, features: RequestFeatures) -> Decision:
        decision = await self.port.schedule(features)
        self.decisions.append((features, decision))
        return decision

    def __getattr__(self, name: str) -> Any:
        return getattr(self.port, name)


@dataclass
class Stack:
    url: str
    instances: dict[str, VllmCpuInstance]
    reference: VllmCpuInstance
    scheduler: SchedulerServer
    port: Recording


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("kv-aware")
    registry = RegistryHandle(free_port_run())
    registry.start()
    instances: dict[str, VllmCpuInstance] = {}

    def make(name: str, role: str | None, core: str) -> VllmCpuInstance:
        connector: dict[str, Any] = (
            {"kv_port": free_port_run(), "registry": registry.address, "instance_id": name}
            if role
            else {}
        )
        inst = VllmCpuInstance(
            VllmCpuOptions(
                model=tiny_model,
                port=free_port_run(),
                served_model_name=MODEL_NAME,
                role=role,  # type: ignore[arg-type]
                max_model_len=2048,
                num_gpu_blocks=96,
                omp_threads_bind=core,
                kv_load_failure_policy="recompute",
                **connector,
            ),
            logs / f"{name}.log",
        )
        inst.process.die_with_parent = True
        return inst

    for i, name in enumerate(PREFILLS):
        instances[name] = make(name, "kv_producer", str(i % 2))
    for i, name in enumerate(DECODES):
        instances[name] = make(name, "kv_consumer", str((i + 1) % 2))
    reference = make("reference", None, "1")
    everything = [*instances.values(), reference]
    try:
        for inst in everything:
            inst.start()
        for inst in everything:
            inst.wait_healthy(600)
        with running_scheduler_server(
            registry.address,
            local_prefill_max_tokens=LOCAL_PREFILL_MAX,
            kv_stale_after_s=30.0,  # a busy 2-core machine must not mark streams stale
            # Prefix warming after 2 reads per holder (8 by default): the other tests' shared
            # prefixes are shorter than --kv-warm-min-tokens, so only the warming test warms.
            kv_warm_requests_per_holder=WARM_READS,
        ) as scheduler:
            manager = scheduler.app.kv_index
            assert manager is not None
            index = manager.index

            def all_live() -> bool:
                states = {i.instance_id: i.state for i in index.instances()}
                return all(states.get(n) is KvState.LIVE for n in instances)

            wait_until(all_live, 60.0, what="every instance LIVE in the prefix index")
            port = Recording(RemoteScheduler(scheduler.address, timeout_s=10.0))
            with running_gateway(
                scheduler_port=port,  # type: ignore[arg-type]
                registry=registry.address,
                tokenizer_cache_dir=str(logs / "tokenizers"),
            ) as url:
                wait_until(lambda: http_ok(f"{url}/health"), 60.0, what="gateway /health 200")
                wait_until(
                    lambda: _routing(url) == "precise",
                    60.0,
                    what="precise routing from the fleet's tokenizer",
                )
                yield Stack(url, instances, reference, scheduler, port)
    finally:
        for inst in everything:
            inst.stop()
        registry.stop()


def _routing(url: str) -> str:
    entry = httpx.get(f"{url}/health", timeout=10.0).json()["models"].get(MODEL_NAME, {})
    return str(entry.get("routing", ""))


def _hits(inst: VllmCpuInstance) -> float:
    return metric(inst.url, "vllm:prefix_cache_hits_total")


def _requests(inst: VllmCpuInstance) -> float:
    return metric(inst.url, "vllm:request_success_total")


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}{path}", json=body, timeout=300.0)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _settle(stack: Stack) -> None:
    """Waits until the index applied what the engines published and holds, on the instances
    that served the last request, every full block of its prompt: the precondition of the
    routing assertions that follow (vLLM publishes from its own thread, so a fixed pause would
    only hope). Fails, with the index's view, if an engine never reports them."""
    manager = stack.scheduler.app.kv_index
    assert manager is not None
    features, decision = stack.port.decisions[-1]
    hashes = features.prefix_hashes[BS]
    full = len(hashes)
    served = [decision.decode.instance_id]
    if decision.prefill is not None:
        served.append(decision.prefill.instance_id)
    service = stack.scheduler.app.service
    assert service is not None
    deadline = time.monotonic() + 30

    def at_rest(iid: str) -> bool:
        # The last request released and a load report after its end: a report sent while it
        # ran (running 1, KV cache in use) costs a holder more than the pull it would save.
        c = service.view.candidate(iid)
        return (
            c is not None and service.load(c) - c.kv_cache_usage < 0.5 and c.kv_cache_usage < 0.05
        )

    def quiet() -> bool:
        if not all(s.state is KvState.LIVE and s.lag_events == 0 for s in manager.states()):
            return False
        held = manager.index.match(hashes, instances=served)
        return all(held.get(iid, 0) >= full and at_rest(iid) for iid in served)

    while not quiet():
        held = manager.index.match(hashes, instances=served)
        assert time.monotonic() < deadline, (
            f"the index never showed {full} blocks on {served} at rest: holds {held}; "
            f"{manager.states()}; loads {[service.view.candidate(i) for i in served]}"
        )
        time.sleep(0.05)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_shared_text_prefix_lands_where_it_is_cached_and_vllm_agrees(stack: Stack) -> None:
    # A long shared text prefix (a tenant's system prompt, ~6 blocks) and suffixes longer than
    # --local-prefill-max-tokens: disaggregated even where decode holds the prefix, so the
    # prefill choice is what is tested here.
    shared = " ".join(f"rule {i}: keep the answer short and exact." for i in range(34))

    def prompt(n: int) -> str:
        return shared + " " + " ".join(f"question {n} asks about item {i}" for i in range(20))

    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 8, "temperature": 0}
    out = _post(stack.url, "/v1/completions", {**body, "prompt": prompt(0)})
    ref = _post(stack.reference.url, "/v1/completions", {**body, "prompt": prompt(0)})
    assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    first, d0 = stack.port.decisions[-1]
    assert d0.prefill is not None
    holder = d0.prefill.instance_id
    first_ids = _tokenize(stack, prompt(0))
    assert first.prompt_tokens == len(first_ids)  # exact ids from the fleet's tokenizer
    _settle(stack)

    for i in range(1, 4):
        before = {n: _hits(inst) for n, inst in stack.instances.items()}
        out = _post(stack.url, "/v1/completions", {**body, "prompt": prompt(i)})
        ref = _post(stack.reference.url, "/v1/completions", {**body, "prompt": prompt(i)})
        assert out["choices"][0]["text"] == ref["choices"][0]["text"]  # greedy, same text
        features, decision = stack.port.decisions[-1]
        assert features.prefix_hashes, "the gateway sent no prefix hashes"
        cached = _common(first_ids, _tokenize(stack, prompt(i))) // BS * BS
        assert cached >= 5 * BS
        assert decision.prefill is not None
        assert decision.prefill.instance_id == holder, decision.reason
        assert decision.prefill_cached_tokens == cached, decision.reason
        assert f"prefill kv_aware: cached={cached}/{features.prompt_tokens} tokens" in (
            decision.reason
        )
        grew = _hits(stack.instances[holder]) - before[holder]
        assert abs(grew - decision.prefill_cached_tokens) <= BS, (grew, decision.reason)
        # The decode that took the first request holds the prefix too and is preferred.
        assert decision.decode_cached_tokens >= cached, decision.reason
        _settle(stack)


def _tokenize(stack: Stack, text: str) -> list[int]:
    """The ids vLLM itself computes for `text` (the reference instance's /tokenize)."""
    out = _post(stack.reference.url, "/tokenize", {"model": MODEL_NAME, "prompt": text})
    return list(out["tokens"])


def test_second_chat_turn_goes_to_turn_ones_decode_without_prefill(stack: Stack) -> None:
    words = " ".join(f"topic{i} detail{i * 7}" for i in range(150))
    turn1 = [{"role": "user", "content": f"Summarise this: {words}"}]
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 12, "temperature": 0}
    one = _post(stack.url, "/v1/chat/completions", {**body, "messages": turn1})
    ref_one = _post(stack.reference.url, "/v1/chat/completions", {**body, "messages": turn1})
    answer = one["choices"][0]["message"]["content"]
    assert answer == ref_one["choices"][0]["message"]["content"]
    _, first = stack.port.decisions[-1]
    assert first.prefill is not None  # decode held nothing of it: disaggregated
    decode_id = first.decode.instance_id
    _settle(stack)

    turn2 = [*turn1, {"role": "assistant", "content": answer}]
    turn2.append({"role": "user", "content": "And in one word?"})
    prefill_requests = {n: _requests(stack.instances[n]) for n in PREFILLS}
    two = _post(stack.url, "/v1/chat/completions", {**body, "messages": turn2})
    ref_two = _post(stack.reference.url, "/v1/chat/completions", {**body, "messages": turn2})
    assert two["choices"][0]["message"]["content"] == ref_two["choices"][0]["message"]["content"]
    features, second = stack.port.decisions[-1]
    assert second.decode.instance_id == decode_id, second.reason
    assert second.prefill is None, second.reason  # conditional disaggregation
    assert second.reason.startswith("no prefill: decode holds"), second.reason
    assert features.prompt_tokens - second.decode_cached_tokens <= LOCAL_PREFILL_MAX
    # No prefill leg reached either prefill instance.
    assert {n: _requests(stack.instances[n]) for n in PREFILLS} == prefill_requests


def test_a_prefix_read_often_is_warmed_onto_the_other_prefill_and_vllm_keeps_it(
    stack: Stack,
) -> None:
    # 9 blocks of shared token ids (above --kv-warm-min-tokens, 1024) and own parts longer
    # than --local-prefill-max-tokens: every request has a prefill leg. The first computes
    # the prefix, the next two read it on its holder; the second read asks for a warm.
    shared = _ids(7, 9 * BS)
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0}
    before = {n: _requests(stack.instances[n]) for n in PREFILLS}
    holders = []
    for n in range(1 + WARM_READS):
        prompt = shared + _ids(100 + n, LOCAL_PREFILL_MAX + 2 * BS)
        _post(stack.url, "/v1/completions", {**body, "prompt": prompt})
        _, decision = stack.port.decisions[-1]
        assert decision.prefill is not None, decision.reason
        holders.append(decision.prefill.instance_id)
        _settle(stack)
    assert holders == [holders[0]] * len(holders)
    (other,) = set(PREFILLS) - {holders[0]}
    warms = [d.warm for _, d in stack.port.decisions[-WARM_READS - 1 :] if d.warm is not None]
    assert len(warms) == 1 and warms[0].instance.instance_id == other
    assert warms[0].prefix_tokens == len(shared)
    # vLLM computed the warm as a request of its own and its KV events say it keeps the
    # prefix's blocks: the prefix index holds them on the other prefill.
    wait_until(
        lambda: _requests(stack.instances[other]) == before[other] + 1,
        60.0,
        what="the warm request served by the other prefill",
    )
    manager = stack.scheduler.app.kv_index
    assert manager is not None
    hashes = stack.port.decisions[-1][0].prefix_hashes[BS][:9]
    wait_until(
        lambda: manager.index.match(hashes, instances=[other]).get(other, 0) >= 9,
        30.0,
        what="the prefix index to hold the warmed prefix on the other prefill",
    )
    assert metric(stack.url, "pdplane_gateway_prefix_warms_total", result="sent") == 1
