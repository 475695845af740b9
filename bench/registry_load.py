"""Registry load benchmark: N simulated instances heartbeating at 1 Hz against one registry.

    .venv/bin/python bench/registry_load.py                       # N = 100, 1000, 10000; aio
    .venv/bin/python bench/registry_load.py --n 1000 --flavour aio,sync --duration-s 15

For each flavour and N it starts `pdplane registry` as its own process, registers N instances,
attaches one watcher (as the scheduler does; `--max-batch`), then sends every instance's
heartbeat once a second, evenly spread, from `--clients` load-generator processes (asyncio gRPC; the
thread-per-instance client library would not scale to 10,000 simulated instances in one
process). Each heartbeat carries a changed load report unless `--static-load`, so every
heartbeat is also an UPDATED event on the watch.

Printed per run: heartbeats/s achieved vs. target, p50/p99/max heartbeat latency (ms, client
side, send to reply), the registry's CPU use (% of one core, from /proc), watch events
received, instances lost (leases that expired under load), and the generators' own p99
lateness (when that grows past a few ms the generator, not the registry, is the bottleneck)
and the machine's 1-minute load average at the end of the run (other processes share the cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdplane.core import grpc_util
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_REGISTER_CONCURRENCY = 200


def _spec(i: int) -> instance_pb2.InstanceSpec:
    return instance_pb2.InstanceSpec(
        instance_id=f"sim-{i:05d}",
        role=instance_pb2.ROLE_PREFILL if i % 2 else instance_pb2.ROLE_DECODE,
        model="bench",
        url=f"http://127.0.0.1:{10000 + i % 50000}",
        kv_endpoint=f"127.0.0.1:{10000 + i % 50000}",
        transport=instance_pb2.TRANSPORT_TCP,
        tp_size=1,
        kv_layout=instance_pb2.KvLayout(
            num_layers=32, num_kv_heads=8, head_size=128, block_size=16, dtype="bfloat16"
        ),
        max_model_len=8192,
        version="bench",
    )


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---------------------------------------------------------------- load generator (child process)


async def _instance(
    stub: registry_pb2_grpc.RegistryStub,
    i: int,
    lease: str,
    start: float,
    end: float,
    static: bool,
    out: dict[str, Any],
) -> None:
    next_at = start + random.random()  # spread the N heartbeats evenly over each second
    while next_at < end:
        await asyncio.sleep(max(0.0, next_at - time.time()))
        out["late"].append((time.time() - next_at) * 1000)
        running = 0 if static else random.randrange(64)
        load = instance_pb2.LoadReport(num_running=running, kv_cache_usage=running / 64)
        sent = time.perf_counter()
        try:
            await stub.Heartbeat(
                registry_pb2.HeartbeatRequest(
                    instance_id=f"sim-{i:05d}", lease_id=lease, load=load
                ),
                timeout=5,
            )
            out["lat"].append((time.perf_counter() - sent) * 1000)
        except grpc.aio.AioRpcError as exc:
            out["errors"][exc.code().name] = out["errors"].get(exc.code().name, 0) + 1
            out.setdefault("details", {}).setdefault(exc.code().name, exc.details())
        next_at += 1.0


async def _generate(args: argparse.Namespace) -> dict[str, Any]:
    ids = range(args.first, args.first + args.count)
    async with grpc_util.aio_channel(args.address) as chan:
        stub = registry_pb2_grpc.RegistryStub(chan)
        gate = asyncio.Semaphore(_REGISTER_CONCURRENCY)

        async def register(i: int) -> str:
            async with gate:
                reply = await stub.Register(registry_pb2.RegisterRequest(spec=_spec(i)), timeout=30)
                return reply.lease_id

        leases = await asyncio.gather(*(register(i) for i in ids))
        print("registered", flush=True)  # the parent starts the clock for everyone at once
        start = float(sys.stdin.readline())
        out: dict[str, Any] = {"lat": [], "late": [], "errors": {}}
        end = start + args.duration_s
        await asyncio.gather(
            *(
                _instance(stub, i, lease, start, end, args.static_load, out)
                for i, lease in zip(ids, leases, strict=True)
            )
        )
    return out


# ------------------------------------------------------------------------ orchestration (parent)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime + stime


def _wait_serving(address: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with grpc_util.channel(address) as chan:
        stub = health_pb2_grpc.HealthStub(chan)
        while time.monotonic() < deadline:
            try:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                return
            except grpc.RpcError:
                time.sleep(0.1)
    raise RuntimeError(f"registry at {address} did not come up")


class _WatchCounter:
    """One watcher, like the scheduler: counts events, and REMOVED ones (lost instances)."""

    def __init__(self, address: str, max_batch: int) -> None:
        self._channel = grpc_util.channel(address)
        stub = registry_pb2_grpc.RegistryStub(self._channel)
        request = registry_pb2.WatchInstancesRequest(max_batch=max_batch)
        self._call = stub.WatchInstances(request)
        self.events = self.removed = self.snapshots = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for message in self._call:
                batch = message.type == registry_pb2.WatchEvent.BATCH
                for event in message.events if batch else [message]:
                    self.events += 1
                    self.removed += event.type == registry_pb2.WatchEvent.REMOVED
                    self.snapshots += event.type == registry_pb2.WatchEvent.SNAPSHOT
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(timeout=5)
        self._channel.close()


def _run_one(flavour: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    port = _free_port()
    address = f"127.0.0.1:{port}"
    registry = subprocess.Popen(
        [sys.executable, "-m", "pdplane.cli.main", "registry", "--port", str(port),
         "--flavour", flavour, "--log-level", "WARNING"],
    )  # fmt: skip
    generators: list[subprocess.Popen[str]] = []
    watches: list[_WatchCounter] = []
    try:
        _wait_serving(address, 30)
        watches += [_WatchCounter(address, args.max_batch) for _ in range(args.watchers)]
        watch = watches[0]
        share = -(-n // args.clients)
        for first in range(0, n, share):
            command = [sys.executable, __file__, "--generate", "--address", address]
            command += ["--first", str(first), "--count", str(min(share, n - first))]
            command += ["--duration-s", str(args.duration_s)]
            command += ["--static-load"] if args.static_load else []
            generators.append(
                subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            )
        for gen in generators:
            assert gen.stdout is not None
            if gen.stdout.readline().strip() != "registered":
                return {
                    "flavour": flavour,
                    "n": n,
                    "watchers": args.watchers,
                    "failed": "registration did not complete (see the generator's error)",
                }
        start = time.time() + 0.5
        for gen in generators:
            assert gen.stdin is not None
            gen.stdin.write(f"{start}\n")
            gen.stdin.flush()
        time.sleep(max(0.0, start - time.time()))
        cpu0, events0 = _cpu_seconds(registry.pid), watch.events
        time.sleep(args.duration_s)
        cpu = _cpu_seconds(registry.pid) - cpu0
        events = watch.events - events0
        results = [json.loads(gen.communicate(timeout=120)[0]) for gen in generators]
    finally:
        for w in watches:
            w.close()
        for gen in generators:
            if gen.poll() is None:
                gen.kill()
        registry.send_signal(signal.SIGTERM)
        registry.wait(timeout=30)
    lat = [x for r in results for x in r["lat"]]
    late = [x for r in results for x in r["late"]]
    errors: dict[str, int] = {}
    for r in results:
        for code, count in r["errors"].items():
            errors[code] = errors.get(code, 0) + count
    return {
        "flavour": flavour,
        "n": n,
        "watchers": args.watchers,
        "target_hb_s": n,
        "achieved_hb_s": round(len(lat) / args.duration_s, 1),
        "p50_ms": round(_percentile(lat, 0.50), 2),
        "p99_ms": round(_percentile(lat, 0.99), 2),
        "max_ms": round(max(lat, default=float("nan")), 2),
        "registry_cpu_pct": round(100 * cpu / args.duration_s, 1),
        "watch_events_s": round(events / args.duration_s, 1),
        "lost_instances": watch.removed,
        "errors": errors,
        "error_details": {k: v for r in results for k, v in r.get("details", {}).items()},
        "generator_late_p99_ms": round(_percentile(late, 0.99), 1),
        "loadavg_1m": round(os.getloadavg()[0], 1),
    }


def _row(r: dict[str, Any]) -> str:
    head = f"{r['flavour']:<5} {r['watchers']:>3} {r['n']:>6} "
    if "failed" in r:
        return head + "FAILED: " + r["failed"]
    return (
        head + f"{r['achieved_hb_s']:>9}/{r['target_hb_s']:<6} "
        f"{r['p50_ms']:>7} {r['p99_ms']:>8} {r['max_ms']:>8} {r['registry_cpu_pct']:>7} "
        f"{r['watch_events_s']:>9} {r['lost_instances']:>5} {r['generator_late_p99_ms']:>8} "
        f"{r['loadavg_1m']:>6} {r['errors'] or ''}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", default="100,1000,10000", help="instance counts, comma-separated")
    parser.add_argument("--flavour", default="aio", help="aio, sync or aio,sync")
    parser.add_argument("--duration-s", type=float, default=10.0, help="heartbeat window (s)")
    parser.add_argument("--clients", type=int, default=2, help="load-generator processes")
    parser.add_argument("--static-load", action="store_true", help="unchanged load reports")
    parser.add_argument("--watchers", type=int, default=1, help="open watch streams (>= 1)")
    parser.add_argument(
        "--max-batch", type=int, default=256, help="watch events per message (the client's 256)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per run")
    parser.add_argument("--generate", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.generate:
        print(json.dumps(asyncio.run(_generate(args))), flush=True)
        return 0
    print(f"cores: {os.cpu_count()}, window {args.duration_s:.0f} s, {args.clients} generator(s)")
    print(
        "flavour  W      N   hb/s achieved    p50ms    p99ms    maxms  cpu%1c  events/s  lost"
        "  late99ms  load1 errors"
    )
    for flavour in args.flavour.split(","):
        for n in (int(x) for x in args.n.split(",")):
            result = _run_one(flavour, n, args)
            print(json.dumps(result) if args.json else _row(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
