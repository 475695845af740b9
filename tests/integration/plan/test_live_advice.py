"""Live advice on a running sim fleet behind the real gateway: overloaded decodes say
"decode-bound, add decode", an overloaded prefill says the opposite, and the gauges follow."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
import httpx
import pytest

from pdplane.cli.main import main as pdplane_main
from pdplane.launch.ports import free_port_run
from pdplane.plan.live import Advice
from pdplane.plan.live_cli import run_live
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from tests.integration.gateway.conftest import MODEL, Stack, wait_for


@contextmanager
def load(url: str, n: int, prompt_words: int, max_tokens: int) -> Iterator[None]:
    """`n` concurrent streamed completions through the gateway, cancelled on exit."""
    stop = threading.Event()

    def one(i: int) -> None:
        body = {
            "model": MODEL,
            "prompt": " ".join(f"w{i}x{k}" for k in range(prompt_words)),
            "max_tokens": max_tokens,
            "stream": True,
        }
        while not stop.is_set():
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
                    for _ in r.iter_bytes():
                        if stop.is_set():
                            return
            except httpx.HTTPError:
                return

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)


def _advice(stack: Stack, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    argv = ["plan", "--registry", stack.registry, "--window", "1.5s", "--interval-s", "0.1"]
    assert pdplane_main([*argv, "--gateway", stack.url, "--json"]) == 0
    out: dict[str, object] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return out


def _queued(stack: Stack, role: str) -> Callable[[], bool]:
    """True once an instance of `role` reports a queue of two or more."""
    want = instance_pb2.Role.Value(f"ROLE_{role.upper()}")

    def check() -> bool:
        with grpc.insecure_channel(stack.registry) as ch:
            reply = registry_pb2_grpc.RegistryStub(ch).ListInstances(
                registry_pb2.ListInstancesRequest(), timeout=5
            )
        return any(i.spec.role == want and i.load.num_waiting >= 2 for i in reply.instances)

    return check


def test_long_outputs_make_it_decode_bound(
    stack_factory: Callable[..., Stack], capsys: pytest.CaptureFixture[str]
) -> None:
    stack = stack_factory(embedded=True)
    p = stack.sims(["prefill"], itl_ms=2)
    d = stack.sims(["decode"], itl_ms=5, max_num_seqs=2)
    stack.wait_ready(p)
    stack.wait_ready(d)
    with load(stack.url, n=8, prompt_words=20, max_tokens=2000):
        wait_for(_queued(stack, "decode"), 10, "a decode queue in the load reports")
        out = _advice(stack, capsys)
    assert out["advice"] == "decode-bound, add decode", out
    assert out["delta"] == {"prefill": 0, "decode": 1}


def test_long_prompts_make_it_prefill_bound(
    stack_factory: Callable[..., Stack], capsys: pytest.CaptureFixture[str]
) -> None:
    stack = stack_factory(embedded=True)
    p = stack.sims(["prefill"], itl_ms=1, ttft_per_token_ms=2.0, max_num_batched_tokens=400)
    d = stack.sims(["decode"], itl_ms=1)
    stack.wait_ready(p)
    stack.wait_ready(d)
    with load(stack.url, n=8, prompt_words=300, max_tokens=2):
        wait_for(_queued(stack, "prefill"), 10, "a prefill queue in the load reports")
        out = _advice(stack, capsys)
    assert out["advice"] == "prefill-bound, add prefill", out
    assert out["delta"] == {"prefill": 1, "decode": 0}


def test_gauges_follow_the_verdict(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(embedded=True)
    sims = stack.sims(["prefill", "decode"], itl_ms=1)
    stack.wait_ready(sims)
    port = free_port_run()
    stop = threading.Event()
    seen: list[Advice] = []

    def on_advice(a: Advice) -> None:
        seen.append(a)

    t = threading.Thread(
        target=run_live,
        args=(stack.registry,),
        kwargs={
            "window_s": 0.5,
            "interval_s": 0.05,
            "serve_metrics": port,
            "stop": stop,
            "on_advice": on_advice,
        },
        daemon=True,
    )
    t.start()
    try:
        wait_for(lambda: len(seen) >= 3, 10, "three verdicts")
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        stop.set()
        t.join(timeout=10)
    assert 'pdplane_plan_bottleneck{role="decode"} 0.0' in text
    assert 'pdplane_plan_instances_delta{role="prefill"} 0.0' in text
    assert seen[-1].summary == "balanced, keep"


def test_unreachable_registry_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--registry", f"127.0.0.1:{free_port_run()}", "--window", "0.1s"]
    assert pdplane_main(argv) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err
