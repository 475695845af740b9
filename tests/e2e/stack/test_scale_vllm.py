"""Scaling a live XpYd deployment of real vLLM instances.

Two more decode instances join the session's 1P1D pair (1P3D): each registers and receives
requests; one is drained and stopped while requests keep flowing (zero failures); then, with
1P2D, the other is killed mid-stream: its stream continues on the remaining decode (request
migration) and ends as asked, with no error event, and the next requests succeed there.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdplane.core import defaults
from pdplane.core.grpc.util import channel
from pdplane.gateway.testing import running_gateway
from pdplane.launch.ports import free_port_run
from pdplane.launch.process import http_ok, wait_until
from pdplane.launch.vllm_cpu import VllmCpuInstance, VllmCpuOptions
from pdplane.scheduler.server import SchedulerServer
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from tests.e2e.conftest import MODEL_NAME, RegistryHandle, VllmPair
from tests.e2e.connector.helpers import metric
from tests.e2e.stack.conftest import fresh_text
from tests.integration.scheduler.fixtures import running_scheduler_server

pytestmark = pytest.mark.vllm

START_TIMEOUT_S = 300.0
LEASE_TTL_S = defaults.LEASE_TTL_MS / 1000


@dataclass
class Scaled:
    gateway: str
    scheduler: SchedulerServer
    extra: dict[str, VllmCpuInstance] = field(default_factory=dict)


@pytest.fixture(scope="module")
def scaled(
    registry: RegistryHandle,
    vllm_pair: VllmPair,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Scaled]:
    """A round-robin scheduler + gateway over the pair, plus decode-2 and decode-3 started and
    registered while that gateway already serves."""
    logs = tmp_path_factory.mktemp("scale-logs")
    with (
        running_scheduler_server(registry.address, decode_policy="round_robin") as scheduler,
        running_gateway(scheduler.address, registry.address) as url,
    ):
        wait_until(lambda: http_ok(f"{url}/health"), 60.0, what="gateway /health 200")
        scaled = Scaled(url, scheduler)
        for name, core in (("decode-2", "0"), ("decode-3", "1")):
            options = VllmCpuOptions(
                model=tiny_model,
                port=free_port_run(),
                served_model_name=MODEL_NAME,
                role="kv_consumer",
                kv_port=free_port_run(),
                instance_id=name,
                registry=registry.address,
                omp_threads_bind=core,
            )
            scaled.extra[name] = VllmCpuInstance(options, logs / f"{name}.log")
        try:
            for inst in scaled.extra.values():
                inst.start()
            for inst in scaled.extra.values():
                inst.wait_healthy(START_TIMEOUT_S)
            wait_until(
                lambda: {"decode-2", "decode-3"} <= {i.spec.instance_id for i in registry.list()},
                30.0,
                what="decode-2 and decode-3 registered",
            )
            yield scaled
        finally:
            for inst in scaled.extra.values():
                inst.stop()


def _complete(url: str, tag: str, max_tokens: int = 8) -> httpx.Response:
    body = {
        "model": MODEL_NAME,
        "prompt": fresh_text(tag),
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120.0)


def _successes(inst: VllmCpuInstance) -> float:
    return metric(inst.url, "vllm:request_success_total")


def _decode_candidate(scheduler: SchedulerServer, instance_id: str) -> Any:
    assert scheduler.app.view is not None
    return next(
        (c for c in scheduler.app.view.candidates(MODEL_NAME) if c.instance_id == instance_id),
        None,
    )


def _drain(registry: RegistryHandle, instance_id: str) -> None:
    inst = registry.get(instance_id)
    assert inst is not None
    with channel(registry.address) as ch:
        reply = registry_pb2_grpc.RegistryStub(ch).Deregister(
            registry_pb2.DeregisterRequest(
                instance_id=instance_id, lease_id=inst.lease_id, drain=True
            ),
            timeout=5.0,
        )
    assert reply.state == instance_pb2.INSTANCE_STATE_DRAINING


def test_new_decode_instances_register_and_receive_requests(scaled: Scaled) -> None:
    before = {name: _successes(inst) for name, inst in scaled.extra.items()}
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda i: _complete(scaled.gateway, f"join{i}"), range(9)))
    assert [r.status_code for r in replies] == [200] * 9
    for name, inst in scaled.extra.items():
        assert _successes(inst) > before[name], f"{name} got no request"


def test_drain_and_stop_while_serving_loses_no_request(
    scaled: Scaled, registry: RegistryHandle
) -> None:
    stop = threading.Event()
    statuses: list[int] = []

    def load() -> None:
        i = 0
        while not stop.is_set():
            statuses.append(_complete(scaled.gateway, f"drain{i}").status_code)
            i += 1

    with ThreadPoolExecutor(3) as pool:
        workers = [pool.submit(load) for _ in range(3)]
        wait_until(lambda: len(statuses) >= 6, 120.0, what="requests flowing")
        _drain(registry, "decode-2")
        wait_until(
            lambda: not getattr(_decode_candidate(scaled.scheduler, "decode-2"), "serving", False),
            10.0,
            what="the scheduler to see decode-2 draining",
        )
        assert scaled.scheduler.app.service is not None
        inflight = scaled.scheduler.app.service.inflight
        wait_until(
            lambda: inflight.inflight_by_instance().get("decode-2", 0) == 0,
            60.0,
            what="decode-2's in-flight requests to finish",
        )
        scaled.extra["decode-2"].stop()
        served_after_stop = len(statuses)
        wait_until(
            lambda: len(statuses) >= served_after_stop + 6,
            120.0,
            what="requests to keep flowing after the stop",
        )
        stop.set()
        for w in workers:
            w.result(timeout=120.0)
    assert statuses and set(statuses) == {200}, statuses


def _long_stream(url: str, tag: str, events: list[dict[str, Any]], done: threading.Event) -> None:
    body = {
        "model": MODEL_NAME,
        "prompt": fresh_text(tag),
        "max_tokens": 900,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120.0) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    payload = line.removeprefix("data: ")
                    events.append({"done": True} if payload == "[DONE]" else json.loads(payload))
                    events[-1]["t"] = time.monotonic()
    finally:
        done.set()


def test_killing_a_decode_mid_stream_migrates_its_stream_then_service_goes_on(
    scaled: Scaled, registry: RegistryHandle
) -> None:
    victim = scaled.extra["decode-3"]
    assert victim.alive()
    # Round robin over the two serving decodes (decode-0, decode-3): two streams, one on each.
    streams = [([], threading.Event()) for _ in range(2)]
    threads = [
        threading.Thread(target=_long_stream, args=(scaled.gateway, f"kill{i}", ev, done))
        for i, (ev, done) in enumerate(streams)
    ]
    for t in threads:
        t.start()
    wait_until(lambda: all(len(ev) >= 5 for ev, _ in streams), 120.0, what="both streams going")
    victim.process.kill()
    for t in threads:
        t.join(timeout=300.0)
    for ev, _ in streams:
        assert ev and ev[-1].get("done"), ev[-2:]  # one [DONE], last
        assert not [e for e in ev if "error" in e], [e for e in ev if "error" in e]
        reasons = [
            c["finish_reason"] for e in ev for c in e.get("choices", ()) if c.get("finish_reason")
        ]
        assert reasons == ["length"], reasons  # all 900 tokens asked for
    # The killed decode's stream moved (one migration: the connection to it was lost).
    assert metric(scaled.gateway, "pdplane_gateway_migrations_total") >= 1
    replies = [_complete(scaled.gateway, f"afterkill{i}") for i in range(4)]
    assert [r.status_code for r in replies] == [200] * 4
