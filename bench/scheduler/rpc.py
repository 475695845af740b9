"""Schedule RPCs per second of a `pdplane scheduler` process at fleet scale.

    .venv/bin/python bench/scheduler/rpc.py [--instances 1000] [--callers 16,256]
        [--duration-s 5] [--clients 4] [--replicas 1,2] [--baseline-tree PATH] [--json]

A `pdplane registry` process holds `--instances` instances of one model (half prefill, half
decode, 10-minute leases: no heartbeat traffic); a `pdplane scheduler` process watches it with
its default policies. `--clients` load-generator processes (each a gateway's
`RemoteScheduler`: one `ScheduleStream`, Releases riding on the next Schedule) run `--callers`
concurrent callers in all, each calling Schedule and then `release_nowait`, for `--duration-s`
seconds after a warm-up. Printed per row: Schedule/s over all clients in that window, the
round trip's p50 / p99 (ms, nearest rank), and the schedulers' CPU (all replicas, from /proc,
over the whole client run) per Schedule of the run (us) and in % of one core: when the load
generators and schedulers share few cores, CPU per Schedule is the scheduler's own cost and
Schedule/s what this machine sustained.

The schedulers run with `--no-kv-index` unless `--kv-index`: the bench instances' KV event
endpoints do not exist, and a prefix index retrying 1,000 of them cost an idle scheduler ~35 %
of a core, which would count as the Schedules' cost. Without KV events `kv_aware` (the
default) routes by load alone either way.

With `--replicas 2` two schedulers name each other in `--peers` (in-flight assignments
shared) and the clients alternate between them. `--baseline-tree` (a checkout or
`git archive` of another commit) adds rows with that tree's scheduler process, measured in
the same run: the ratio of Schedule/s is the comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from bench.scheduler.decision import spec  # the same bench instances
from pdplane.launch.ports import free_port_run
from pdplane.scheduler.port import Outcome, RequestFeatures, SchedulerUnavailable
from pdplane.scheduler.remote import RemoteScheduler
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from tests.support.stats import percentile

_LEASE_MS = 600_000
_MODEL = "large"
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def _process(
    args: list[str], tree: Path | None = None, port: int | None = None
) -> Iterator[tuple[str, int]]:
    """`pdplane <args> --port P` (from `tree`'s sources when given) until the block ends;
    yields (address, pid)."""
    port = port or free_port_run()
    env = dict(os.environ)
    if tree is not None:  # its sources first, then whatever this process was given
        paths = [str(tree / d) for d in ("services", "connector")]
        env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    command = [sys.executable, "-m", "pdplane.cli.main", *args, "--port", str(port)]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
        yield address, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _register(registry: str, instances: int) -> None:
    half = instances // 2
    with grpc.insecure_channel(registry) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        for i in range(instances):
            role = instance_pb2.ROLE_PREFILL if i < half else instance_pb2.ROLE_DECODE
            request = registry_pb2.RegisterRequest(
                spec=spec(i, role, _MODEL),
                lease_ttl_ms=_LEASE_MS,
                request_id=f"bench-register-{i:08d}" * 2,
            )
            stub.Register(request, timeout=10)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


async def _ready(address: str, instances: int) -> None:
    """Waits until the scheduler decides for the model over every instance."""
    client = RemoteScheduler(address)
    deadline = time.monotonic() + 120
    try:
        while True:
            try:
                await client.schedule(RequestFeatures("probe", _MODEL, 1))
                await client.release("probe", Outcome.SUCCESS)
                return
            except SchedulerUnavailable:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
    finally:
        await client.close()


async def _callers(address: str, callers: int, tag: str, warm_s: float, duration_s: float) -> dict:
    """`callers` concurrent Schedule + release_nowait loops on one RemoteScheduler: the
    Schedules of the measured window (count, round-trip seconds) and of the whole run."""
    client = RemoteScheduler(address, timeout_s=30)
    latencies: list[float] = []
    started = time.monotonic()
    measure_from = started + warm_s
    stop_at = measure_from + duration_s
    done = total = 0

    async def loop(k: int) -> None:
        nonlocal done, total
        n = 0
        while True:
            now = time.monotonic()
            if now >= stop_at:
                return
            request_id = f"{tag}-{k}-{n}"
            n += 1
            t0 = time.perf_counter()
            await client.schedule(RequestFeatures(request_id, _MODEL, 512, 128))
            elapsed = time.perf_counter() - t0
            client.release_nowait(request_id, Outcome.SUCCESS)
            total += 1
            if now >= measure_from and time.monotonic() <= stop_at:
                latencies.append(elapsed)
                done += 1

    try:
        await asyncio.gather(*(loop(k) for k in range(callers)))
    finally:
        await client.close()
    return {"done": done, "total": total, "latencies": latencies}


def _client_main(args: argparse.Namespace) -> None:
    result = asyncio.run(
        _callers(args.address, args.callers, args.tag, args.warm_s, args.duration_s)
    )
    json.dump(result, sys.stdout)


def _run_clients(
    addresses: list[str], callers: int, clients: int, warm_s: float, duration_s: float
) -> tuple[int, int, list[float]]:
    """(Schedules in the measured window, in the whole run, round trips of the window)."""
    procs = []
    for c in range(clients):
        share = callers // clients + (1 if c < callers % clients else 0)
        if share == 0:
            continue
        command = [
            sys.executable,
            __file__,
            "--client",
            "--address",
            addresses[c % len(addresses)],
            "--callers",
            str(share),
            "--tag",
            f"c{c}-{time.monotonic_ns()}",
            "--warm-s",
            str(warm_s),
            "--duration-s",
            str(duration_s),
        ]
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE))
    done = total = 0
    latencies: list[float] = []
    for proc in procs:
        out, _ = proc.communicate(timeout=warm_s + duration_s + 120)
        result = json.loads(out)
        done += result["done"]
        total += result["total"]
        latencies += result["latencies"]
    return done, total, latencies


def _row(
    name: str,
    addresses: list[str],
    pids: list[int],
    callers: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    # The schedulers' CPU over the whole client run (warm-up included) per Schedule of it; an
    # idle scheduler costs ~2 % of a core, which the clients' start adds.
    cpu0 = sum(_cpu_s(pid) for pid in pids)
    t0 = time.monotonic()
    done, total, latencies = _run_clients(
        addresses, callers, args.clients, args.warm_s, args.duration_s
    )
    cpu = sum(_cpu_s(pid) for pid in pids) - cpu0
    wall = time.monotonic() - t0
    return {
        "scheduler": name,
        "replicas": len(pids),
        "callers": callers,
        "schedule_per_s": done / args.duration_s,
        "p50_ms": percentile(latencies, 50) * 1e3,  # nearest rank; NaN when none
        "p99_ms": percentile(latencies, 99) * 1e3,
        "scheduler_cpu_us_per_schedule": cpu / total * 1e6 if total else float("nan"),
        "scheduler_cpu_pct": 100 * cpu / wall,
    }


def _variant(
    name: str, registry: str, replicas: int, tree: Path | None, args: argparse.Namespace
) -> list[dict[str, Any]]:
    with contextlib.ExitStack() as stack:
        ports = [free_port_run() for _ in range(replicas)]
        addresses, pids = [], []
        for i in range(replicas):
            peers = [f"127.0.0.1:{p}" for j, p in enumerate(ports) if j != i]
            extra = ["--peers", ",".join(peers), "--replica-id", f"r{i}"] if peers else []
            if not args.kv_index:
                extra.append("--no-kv-index")
            address, pid = stack.enter_context(
                _process(["scheduler", "--registry", registry, *extra], tree, ports[i])
            )
            addresses.append(address)
            pids.append(pid)
        for address in addresses:
            asyncio.run(_ready(address, args.instances))
        return [
            _row(name, addresses, pids, callers, args)
            for callers in (int(c) for c in args.callers.split(","))
        ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=1000, help="instances of the model")
    parser.add_argument("--callers", default="16,256", help="concurrent callers, per row")
    parser.add_argument("--duration-s", type=float, default=5.0, help="measured seconds a row")
    parser.add_argument("--warm-s", type=float, default=1.0, help="unmeasured seconds first")
    parser.add_argument("--clients", type=int, default=4, help="load-generator processes")
    parser.add_argument("--replicas", default="1,2", help="scheduler replicas, per variant")
    parser.add_argument("--baseline-tree", type=Path, help="another commit's tree, same run")
    parser.add_argument(
        "--kv-index", action="store_true", help="schedulers with their prefix index (see doc)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        args.callers = int(args.callers)
        _client_main(args)
        return
    rows: list[dict[str, Any]] = []
    lease = ["--lease-ttl-ms", str(_LEASE_MS), "--max-lease-ttl-ms", str(_LEASE_MS)]
    with _process(["registry", *lease]) as (registry, _):
        _register(registry, args.instances)
        if args.baseline_tree is not None:
            rows += _variant("baseline", registry, 1, args.baseline_tree, args)
        for replicas in (int(r) for r in args.replicas.split(",")):
            rows += _variant("this tree", registry, replicas, None, args)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = [f"{v:.1f}" if isinstance(v, float) else str(v) for v in row.values()]
        print("| " + " | ".join(cells) + " |")
    base = {r["callers"]: r["schedule_per_s"] for r in rows if r["scheduler"] == "baseline"}
    for row in rows:
        if row["scheduler"] != "baseline" and base.get(row["callers"]):
            ratio = row["schedule_per_s"] / base[row["callers"]]
            print(
                f"  {row['replicas']} replica(s), {row['callers']} callers: {ratio:.1f}x the "
                "baseline's Schedule/s"
            )


if __name__ == "__main__":
    main()
