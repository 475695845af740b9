"""Scheduler decision latency: in-process per policy and fleet size, and the gRPC round trip.

    .venv/bin/python bench/scheduler_decision.py [--sizes 10,100,1000] [--decisions 3000]
        [--rpc-calls 3000] [--json]

In-process: `SchedulerService.schedule` over a static view of N instances (N/2 prefill,
N/2 decode, random loads), same policy on both sides, metrics on, a steady 64 requests in
flight (each decision releases the one scheduled 64 earlier). Rows marked "+report" apply one
new load report (a registry revision) before every decision, so the view's refresh is included:
the worst case of a fleet whose heartbeats all change load.

gRPC: a real registry with 2 prefill + 2 decode instances registered by the registration
client, a real scheduler, and `SchedulerClient.schedule` called sequentially over loopback
(Release not timed); then the same against a 1,000-instance view; then 16 concurrent callers.
Latencies in microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pdplane.registry.client import RegistrationClient
from pdplane.registry.server import RegistryServer
from pdplane.registry.settings import RegistrySettings
from pdplane.scheduler.client import SchedulerClient
from pdplane.scheduler.metrics import SchedulerMetrics
from pdplane.scheduler.policies import POLICIES
from pdplane.scheduler.server import SchedulerServer
from pdplane.scheduler.service import ScheduleInput, SchedulerService
from pdplane.scheduler.settings import SchedulerSettings
from pdplane.scheduler.view import CandidateView, StaticSource
from pdplane.v1 import instance_pb2

_WINDOW = 64  # requests kept in flight during the in-process runs
_LAYOUT = instance_pb2.KvLayout(
    num_layers=2, num_kv_heads=2, head_size=32, block_size=16, dtype="float32"
)


def _spec(index: int, role: instance_pb2.Role.ValueType) -> instance_pb2.InstanceSpec:
    kind = "p" if role == instance_pb2.ROLE_PREFILL else "d"
    return instance_pb2.InstanceSpec(
        instance_id=f"{kind}{index:04d}",
        role=role,
        model="tiny",
        url=f"http://127.0.0.1:{20000 + index}",
        kv_endpoint=f"127.0.0.1:{40000 + index}",
        transport=instance_pb2.TRANSPORT_TCP,
        tp_size=1,
        kv_layout=_LAYOUT,
        max_model_len=4096,
        version="bench",
    )


def _instance(
    index: int, role: instance_pb2.Role.ValueType, rng: random.Random, revision: int
) -> instance_pb2.Instance:
    load = instance_pb2.LoadReport(
        num_running=rng.randrange(8),
        num_waiting=rng.randrange(4),
        kv_cache_usage=rng.random(),
        free_kv_blocks=10_000,
        total_kv_blocks=20_000,
    )
    return instance_pb2.Instance(
        spec=_spec(index, role),
        state=instance_pb2.INSTANCE_STATE_SERVING,
        load=load,
        revision=revision,
    )


def _fleet(size: int, rng: random.Random) -> list[instance_pb2.Instance]:
    half = max(1, size // 2)
    return [_instance(i, instance_pb2.ROLE_PREFILL, rng, i + 1) for i in range(half)] + [
        _instance(i, instance_pb2.ROLE_DECODE, rng, half + i + 1) for i in range(half)
    ]


def _percentiles(samples_ns: list[int]) -> dict[str, float]:
    cuts = statistics.quantiles(samples_ns, n=100, method="inclusive")
    return {"p50_us": cuts[49] / 1e3, "p99_us": cuts[98] / 1e3, "n": len(samples_ns)}


def bench_in_process(size: int, policy: str, decisions: int, churn: bool) -> dict[str, Any]:
    """Times `decisions` calls of SchedulerService.schedule (ns per call)."""
    rng = random.Random(size)
    fleet = _fleet(size, rng)
    source = StaticSource(*fleet)
    service = SchedulerService(
        CandidateView(source),
        prefill_policy=policy,
        decode_policy=policy,
        metrics=SchedulerMetrics(),
        seed=0,
    )
    requests = [
        ScheduleInput(
            request_id=f"r{i}",
            model="tiny",
            prompt_tokens=rng.randrange(16, 2048),
            max_tokens=128,
            routing_key=f"user-{rng.randrange(1000)}",
        )
        for i in range(decisions + 200)
    ]
    samples: list[int] = []
    revision = len(fleet)
    for i, request in enumerate(requests):
        if churn:
            revision += 1
            index = rng.randrange(len(fleet))
            role = fleet[index].spec.role
            source.put(_instance(index % (len(fleet) // 2 or 1), role, rng, revision))
        started = time.perf_counter_ns()
        service.schedule(request)
        elapsed = time.perf_counter_ns() - started
        if i >= 200:  # the first calls warm caches (views, hash rings)
            samples.append(elapsed)
        if i >= _WINDOW:
            service.release(requests[i - _WINDOW].request_id, "success")
    return {
        "instances": size,
        "policy": policy + (" +report" if churn else ""),
        **_percentiles(samples),
    }


async def _time_calls(
    call: Callable[[int], Awaitable[Any]], calls: int, concurrency: int = 1
) -> dict[str, Any]:
    samples: list[int] = []
    counter = iter(range(calls))

    async def worker() -> None:
        for i in counter:
            started = time.perf_counter_ns()
            await call(i)
            samples.append(time.perf_counter_ns() - started)

    wall = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - wall
    return {**_percentiles(samples), "concurrency": concurrency, "calls_per_s": calls / wall}


async def _rpc_rounds(address: str, calls: int, label: str) -> list[dict[str, Any]]:
    client = SchedulerClient(address)
    try:

        async def one(i: int) -> None:
            await client.schedule(f"{label}-{i}", "tiny", 512, 128)
            await client.release(f"{label}-{i}", "success")

        async def schedule_only(i: int) -> None:
            started = time.perf_counter_ns()
            await client.schedule(f"{label}-s{i}", "tiny", 512, 128)
            timings.append(time.perf_counter_ns() - started)
            await client.release(f"{label}-s{i}", "success")

        await _time_calls(one, 200)  # warm-up: channel, HTTP/2 windows
        timings: list[int] = []
        wall = time.perf_counter()
        for i in range(calls):
            await schedule_only(i)
        wall = time.perf_counter() - wall
        sequential = {**_percentiles(timings), "concurrency": 1, "pairs_per_s": calls / wall}

        async def schedule_only_concurrent(i: int) -> None:
            await client.schedule(f"{label}-c{i}", "tiny", 512, 128)

        concurrent = await _time_calls(schedule_only_concurrent, calls, concurrency=16)
        return [{"view": label, **sequential}, {"view": label, **concurrent}]
    finally:
        await client.close()


def bench_rpc(calls: int) -> list[dict[str, Any]]:
    """Schedule round trips through a real registry + scheduler, then a 1,000-instance view."""
    registry = RegistryServer(RegistrySettings.model_validate({"host": "127.0.0.1", "port": 0}))
    registry.start()
    clients: list[RegistrationClient] = []
    rows: list[dict[str, Any]] = []
    try:
        for i, role in enumerate([instance_pb2.ROLE_PREFILL] * 2 + [instance_pb2.ROLE_DECODE] * 2):
            client = RegistrationClient(registry.address, _spec(i, role))
            client.start()
            clients.append(client)
        if not all(c.wait_registered(5.0) for c in clients):
            raise RuntimeError("bench instances did not register")
        settings = {"registry": registry.address, "host": "127.0.0.1", "port": 0}
        server = SchedulerServer(SchedulerSettings.model_validate(settings))
        server.start()
        try:
            rows += asyncio.run(_rpc_rounds(server.address, calls, "registry 2P2D"))
        finally:
            server.stop()
    finally:
        for client in clients:
            client.stop()
        registry.stop()
    source = StaticSource(*_fleet(1000, random.Random(7)))
    settings = {"registry": "unused:0", "host": "127.0.0.1", "port": 0}
    server = SchedulerServer(SchedulerSettings.model_validate(settings), source=source)
    server.start()
    try:
        rows += asyncio.run(_rpc_rounds(server.address, calls, "static 500P500D"))
    finally:
        server.stop()
    return rows


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def fmt(value: Any) -> str:
        return f"{value:.1f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000", help="fleet sizes (instances)")
    parser.add_argument("--decisions", type=int, default=3000, help="timed decisions per row")
    parser.add_argument("--rpc-calls", type=int, default=3000, help="timed Schedule RPCs per row")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    local = [
        bench_in_process(size, policy, args.decisions, churn=False)
        for size in sizes
        for policy in POLICIES
    ]
    local += [bench_in_process(size, "least_loaded", args.decisions, churn=True) for size in sizes]
    rpc = bench_rpc(args.rpc_calls) if args.rpc_calls > 0 else []
    if args.json:
        print(json.dumps({"in_process": local, "grpc": rpc}, indent=2))
        return
    print("In-process decision latency (us)")
    print(_table(local, ["instances", "policy", "p50_us", "p99_us", "n"]))
    print("\ngRPC Schedule round trip over loopback (us)")
    print(_table(rpc, ["view", "concurrency", "p50_us", "p99_us", "n"]))
    for row in rpc:
        rate = row.get("pairs_per_s") or row.get("calls_per_s")
        print(f"  {row['view']}, concurrency {row['concurrency']}: {rate:.0f} Schedule/s")


if __name__ == "__main__":
    main()
