"""Scheduler decision latency: in-process per policy and fleet size, and the gRPC round trip.

    .venv/bin/python bench/scheduler_decision.py [--sizes 10,100,1000] [--decisions 3000]
        [--rpc-calls 3000] [--json]

In-process: `SchedulerService.schedule` over a static view of N instances (N/2 prefill,
N/2 decode, random loads), same policy on both sides, metrics on, a steady 64 requests in
flight (each decision releases the one scheduled 64 earlier); wall-clock and thread-CPU
percentiles (CPU time excludes preemption on a busy machine). Rows marked "+report" apply one
new load report (a registry revision) before every decision, so the view's refresh is included:
the worst case of a fleet whose heartbeats all change load.

gRPC: a `pdplane registry` process holding a 2P2D model ("small") and a 500P500D model
("large"), a `pdplane scheduler` process watching it (both with default policies), and
`RemoteScheduler.schedule` from this process over loopback: sequential calls (each followed by
an untimed Release), then 16 concurrent callers. Latencies in microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc

from pdplane.scheduler.metrics import SchedulerMetrics
from pdplane.scheduler.policies import POLICIES
from pdplane.scheduler.port import Outcome, RequestFeatures, SchedulerUnavailable
from pdplane.scheduler.remote import RemoteScheduler
from pdplane.scheduler.service import SchedulerService
from pdplane.scheduler.view import CandidateView, StaticSource
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc

_WINDOW = 64  # requests kept in flight during the in-process runs
_LEASE_MS = 600_000  # bench instances register once and never heartbeat
_LAYOUT = instance_pb2.KvLayout(
    num_layers=2, num_kv_heads=2, head_size=32, block_size=16, dtype="float32"
)


def _spec(
    index: int, role: instance_pb2.Role.ValueType, model: str = "tiny"
) -> instance_pb2.InstanceSpec:
    kind = "p" if role == instance_pb2.ROLE_PREFILL else "d"
    return instance_pb2.InstanceSpec(
        instance_id=f"{model}-{kind}{index:04d}",
        role=role,
        model=model,
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
        RequestFeatures(
            request_id=f"r{i}",
            model="tiny",
            prompt_tokens=rng.randrange(16, 2048),
            max_tokens=128,
            routing_key=f"user-{rng.randrange(1000)}",
        )
        for i in range(decisions + 200)
    ]
    samples: list[int] = []
    cpu_samples: list[int] = []  # CPU time of this thread: what the decision costs unpreempted
    revision = len(fleet)
    for i, request in enumerate(requests):
        if churn:
            revision += 1
            index = rng.randrange(len(fleet))
            role = fleet[index].spec.role
            source.put(_instance(index % (len(fleet) // 2 or 1), role, rng, revision))
        started, cpu_started = time.perf_counter_ns(), time.thread_time_ns()
        service.schedule(request)
        elapsed, cpu = time.perf_counter_ns() - started, time.thread_time_ns() - cpu_started
        if i >= 200:  # the first calls warm caches (views, hash rings)
            samples.append(elapsed)
            cpu_samples.append(cpu)
        if i >= _WINDOW:
            service.release(requests[i - _WINDOW].request_id, Outcome.SUCCESS)
    return {
        "instances": size,
        "policy": policy + (" +report" if churn else ""),
        **_percentiles(samples),
        **{f"cpu_{k}": v for k, v in _percentiles(cpu_samples).items() if k != "n"},
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


async def _rpc_rounds(address: str, model: str, calls: int, label: str) -> list[dict[str, Any]]:
    client = RemoteScheduler(address)
    try:

        async def one(i: int) -> None:
            await client.schedule(RequestFeatures(f"{label}-{i}", model, 512, 128))
            await client.release(f"{label}-{i}", Outcome.SUCCESS)

        await _time_calls(one, 200)  # warm-up: channel, HTTP/2 windows
        timings: list[int] = []
        wall = time.perf_counter()
        for i in range(calls):
            started = time.perf_counter_ns()
            await client.schedule(RequestFeatures(f"{label}-s{i}", model, 512, 128))
            timings.append(time.perf_counter_ns() - started)
            await client.release(f"{label}-s{i}", Outcome.SUCCESS)
        wall = time.perf_counter() - wall
        sequential = {**_percentiles(timings), "concurrency": 1, "pairs_per_s": calls / wall}

        async def schedule_only(i: int) -> None:
            await client.schedule(RequestFeatures(f"{label}-c{i}", model, 512, 128))

        concurrent = await _time_calls(schedule_only, calls, concurrency=16)
        return [{"view": label, **sequential}, {"view": label, **concurrent}]
    finally:
        await client.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _service(*args: str) -> Iterator[str]:
    """`pdplane <args> --port P` as a child process until the block ends; yields its address."""
    port = _free_port()
    command = [sys.executable, "-m", "pdplane.cli.main", *args, "--port", str(port)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _register(registry: str, model: str, prefill: int, decode: int) -> None:
    """Registers instances with a 10-minute lease (no heartbeats needed during the bench)."""
    roles = [instance_pb2.ROLE_PREFILL] * prefill + [instance_pb2.ROLE_DECODE] * decode
    with grpc.insecure_channel(registry) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        for index, role in enumerate(roles):
            request = registry_pb2.RegisterRequest(
                spec=_spec(index, role, model), lease_ttl_ms=_LEASE_MS
            )
            stub.Register(request, timeout=5)


def bench_rpc(calls: int) -> list[dict[str, Any]]:
    """Schedule round trips to a `pdplane scheduler` process watching a `pdplane registry`
    process, for a 2P2D model and a 500P500D model (client in this process)."""
    lease = ["--lease-ttl-ms", str(_LEASE_MS), "--max-lease-ttl-ms", str(_LEASE_MS)]
    rows: list[dict[str, Any]] = []
    with _service("registry", *lease) as registry:
        _register(registry, "small", 2, 2)
        _register(registry, "large", 500, 500)
        with _service("scheduler", "--registry", registry) as scheduler:
            probe = RemoteScheduler(scheduler)

            async def until_ready() -> None:
                deadline = time.monotonic() + 30
                for model in ("small", "large"):
                    while True:
                        try:
                            await probe.schedule(RequestFeatures("probe", model, 1))
                            break
                        except SchedulerUnavailable:
                            if time.monotonic() > deadline:
                                raise
                            await asyncio.sleep(0.05)
                await probe.release("probe", Outcome.SUCCESS)
                await probe.close()

            asyncio.run(until_ready())
            rows += asyncio.run(_rpc_rounds(scheduler, "small", calls, "2P2D"))
            rows += asyncio.run(_rpc_rounds(scheduler, "large", calls, "500P500D"))
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
    print(_table(local, ["instances", "policy", "p50_us", "p99_us", "cpu_p50_us", "cpu_p99_us"]))
    print("\ngRPC Schedule round trip over loopback (us)")
    print(_table(rpc, ["view", "concurrency", "p50_us", "p99_us", "n"]))
    for row in rpc:
        rate = row.get("pairs_per_s") or row.get("calls_per_s")
        print(f"  {row['view']}, concurrency {row['concurrency']}: {rate:.0f} Schedule/s")


if __name__ == "__main__":
    main()
