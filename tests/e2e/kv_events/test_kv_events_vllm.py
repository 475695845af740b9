"""Real vLLM CPU: the connector's KvEvents stream and the scheduler's index match vLLM's cache.

One instance of its own (kv_both, 12 KV blocks of 128 tokens, so it evicts), no registry: the
index follows a fixed view of it. Prompts are token ids, so the test knows the exact tokens.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdplane.core.prefix_hash import block_hashes
from pdplane.launch.ports import free_port_run
from pdplane.launch.vllm_cpu import VllmCpuInstance, VllmCpuOptions
from pdplane.scheduler.kv_index import KvIndexManager, KvState
from pdplane.scheduler.view import StaticSource
from pdplane.v1 import instance_pb2

pytestmark = pytest.mark.vllm

BS = 128  # vLLM CPU's block size
NAME = "kvev-0"


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmCpuInstance]:
    inst = VllmCpuInstance(
        VllmCpuOptions(
            model=tiny_model,
            port=free_port_run(),
            role="kv_both",
            kv_port=free_port_run(),
            served_model_name="tiny",
            num_gpu_blocks=12,
            omp_threads_bind="0",
        ),
        tmp_path_factory.mktemp("kvev") / "vllm.log",
    )
    inst.process.die_with_parent = True
    inst.start()
    try:
        inst.wait_healthy(300)
        yield inst
    finally:
        inst.stop()


def _complete(inst: VllmCpuInstance, prompt: list[int]) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    req = urllib.request.Request(
        f"{inst.url}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200


def _hits(inst: VllmCpuInstance) -> float:
    with urllib.request.urlopen(f"{inst.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:prefix_cache_hits":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise AssertionError("vllm:prefix_cache_hits not exported")


def _view(inst: VllmCpuInstance) -> StaticSource:
    return StaticSource(
        instance_pb2.Instance(
            spec=instance_pb2.InstanceSpec(instance_id=NAME, kv_endpoint=inst.kv_endpoint)
        )
    )


def _prompt(seed: int, tokens: int = 4 * BS + 20) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(tokens)]


def _settle(manager: KvIndexManager, inst: VllmCpuInstance) -> None:
    """Waits until the index has applied everything the engine published so far."""
    deadline = time.monotonic() + 10
    while True:
        state = manager.states()[0]
        if state.state is KvState.LIVE and state.lag_events == 0 and state.last_message_age_s < 1:
            time.sleep(0.3)  # vLLM publishes from its own thread: let a last batch land
            if manager.states()[0].lag_events == 0:
                return
        assert time.monotonic() < deadline, state
        time.sleep(0.05)


def test_index_matches_vllm_cache_evictions_restart_and_stale(engine: VllmCpuInstance) -> None:
    manager = KvIndexManager(_view(engine), stale_after_s=2.0)
    manager.start()
    try:
        assert manager.wait_live(30)
        a = _prompt(1)
        _complete(engine, a)
        _settle(manager, engine)
        a_hashes = block_hashes(a, BS)
        assert manager.index.match(a_hashes) == {NAME: 4}  # the 4 full prompt blocks

        # vLLM's own view: the same prompt again hits exactly the predicted tokens
        before = _hits(engine)
        _complete(engine, a)
        assert _hits(engine) - before == 4 * BS

        # a restarted scheduler is exact from the snapshot before routing anything
        restarted = KvIndexManager(_view(engine))
        restarted.start()
        try:
            assert restarted.wait_live(30)
            assert restarted.index.match(a_hashes) == {NAME: 4}
        finally:
            restarted.stop()

        # other prompts fill the 12-block cache: a's blocks are evicted
        for seed in (2, 3, 4):
            _complete(engine, _prompt(seed))
        _settle(manager, engine)
        predicted = manager.index.match(a_hashes).get(NAME, 0)
        assert predicted < 4
        before = _hits(engine)
        _complete(engine, a)
        assert _hits(engine) - before == predicted * BS  # exactly what vLLM still had

        # the instance's event stream dies: stale within the bound, never matched
        engine.stop()
        started = time.monotonic()
        while manager.states()[0].state is not KvState.STALE:
            assert time.monotonic() - started < 2.0 + 1.0
            time.sleep(0.05)
        assert manager.index.match(a_hashes) == {}
    finally:
        manager.stop()
