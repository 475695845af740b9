"""Registry load benchmark: N simulated instances heartbeating at 1 Hz, memory and etcd stores.

    .venv/bin/python bench/registry/load.py                           # N = 1000, 10000; both stores
    .venv/bin/python bench/registry/load.py --n 1000 --store etcd --mode stream,unary
    .venv/bin/python bench/registry/load.py --n 10000 --store etcd --replicas 2 --etcd-members 3
    # the registry on CPUs 0,1, the load on the others (a machine with 16 cores):
    .venv/bin/python bench/registry/load.py --n 10000 --store memory --registry-cpus 0,1 \
        --clients 12
    .venv/bin/python bench/registry/load.py --n 10000 --store etcd --replicas 2 \
        --registry-cpus 0,1 --clients 12
    # 10,000 instances behind a heartbeat relay per 8-instance host (pdplane registry-relay):
    .venv/bin/python bench/registry/load.py --n 10000 --store memory,etcd --mode relay \
        --per-host 8 --registry-cpus 0

For each store, heartbeat mode and N it starts `pdplane registry` as its own process (or
`--replicas` of them over one etcd cluster of `--etcd-members` members on loopback, data on
tmpfs), registers N instances from `--clients` load-generator processes (asyncio gRPC; each
instance one `HeartbeatStream`, or unary `Heartbeat` calls with `--mode unary`), then sends
every instance's heartbeat once a second, evenly spread. `--mode relay` plays what the
registry receives from hosts running `pdplane registry-relay`: each group of `--per-host`
instances is one host with its own connection and one `HeartbeatBatchStream`, which sends the
host's heartbeats as one batch a second (hosts evenly spread over the second); the latency is
then a batch's, send to answer (an instance behind a relay is answered by the relay at once).
Every heartbeat carries a changed load report whose `recv_buffer_headroom_bytes` is its send
time (us), so every heartbeat is an UPDATED event and a watcher process (one WatchInstances
stream, batches of 256, on the first replica) measures the fan-out latency: heartbeat sent ->
event received. `--registry-cpus` pins the registry processes to those CPUs and the generators,
the watcher and etcd to the others (a registry on 2 cores driven by load generators that do not
compete with it). A refused Register is counted and retried (5 attempts, the same request id),
as instances do.

Printed per run: heartbeats/s achieved vs. target; p50/p99 heartbeat latency (ms, client side,
send to answer); the registry's CPU (% of one core, all replicas, from /proc) and per heartbeat
(us); etcd's CPU (% of one core, all members) and its raft proposals committed per second (its
writes: every Put/Txn is one; lease keep-alives are not); watch fan-out p50/p99 (ms); instances
lost (REMOVED events); the generators' p99 lateness (when it grows past a few ms the load side,
not the registry, is behind) and the machine's 1-minute load average (the cores are shared).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc

from pdplane.core.grpc import util as grpc_util
from pdplane.launch.etcd import EtcdCluster
from pdplane.launch.ports import free_port_run
from pdplane.launch.process import ManagedProcess, grpc_serving, wait_until
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from tests.support.stats import percentile

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_REGISTER_CONCURRENCY = 100
_REGISTER_ATTEMPTS, _REGISTER_TIMEOUT_S = 5, 20.0
_Ev = registry_pb2.WatchEvent


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


def _load() -> instance_pb2.LoadReport:
    running = random.randrange(64)
    return instance_pb2.LoadReport(
        num_running=running,
        kv_cache_usage=running / 64,
        recv_buffer_headroom_bytes=time.time_ns() // 1000,  # the send time, for the watcher
    )


# ------------------------------------------------------------ load generator (child process)


class _Window:
    """The measured window (unix s); heartbeats run from registration until its end."""

    def __init__(self) -> None:
        self.start = float("inf")
        self.end = float("inf")

    def measured(self, t: float) -> bool:
        return self.start <= t <= self.end


async def _paced(
    call: Any,
    request: Any,
    count: int,
    window: _Window,
    out: Any,
    refused: Any = lambda reply: (),
) -> None:
    """Writes `request()` on the bidirectional `call` once a second (first at a random phase:
    the generators' streams spread evenly over each second) and reads each answer; `count`
    heartbeats per message; `refused(reply)` lists (code, details) of heartbeats it refused."""
    next_at = time.time() + random.random()
    try:
        while next_at < window.end:
            await asyncio.sleep(max(0.0, next_at - time.time()))
            if window.measured(next_at):
                out["late"].append((time.time() - next_at) * 1000)
            sent = time.perf_counter()
            await call.write(request())
            reply = await call.read()
            if reply is grpc.aio.EOF:
                _failed(out, (await call.code()).name, await call.details())
                return
            for code, details in refused(reply):
                _failed(out, code, details)
            if window.measured(next_at):
                out["lat"].append((time.perf_counter() - sent) * 1000)
                out["beats"] += count
            next_at += 1.0
        await call.done_writing()
    except grpc.aio.AioRpcError as exc:
        _failed(out, exc.code().name, exc.details() or "")
    except asyncio.InvalidStateError:
        _failed(out, (await call.code()).name, await call.details())


def _failed(out: Any, code: str, details: str) -> None:
    out["errors"][code] = out["errors"].get(code, 0) + 1
    out["details"].setdefault(code, details)


_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


async def _beat_host(
    stub: registry_pb2_grpc.RegistryStub, members: list[tuple[int, str]], window: _Window, out: Any
) -> None:
    """One host's relay: the heartbeats of `members` ((instance index, lease id)) as one
    HeartbeatBatch a second."""

    def batch() -> registry_pb2.HeartbeatBatch:
        return registry_pb2.HeartbeatBatch(
            heartbeats=[
                registry_pb2.HeartbeatRequest(
                    instance_id=f"sim-{i:05d}", lease_id=lease, load=_load()
                )
                for i, lease in members
            ]
        )

    def refused(reply: registry_pb2.HeartbeatBatchResponse) -> list[tuple[str, str]]:
        return [(_CODE_NAMES[o.code], o.details) for o in reply.outcomes if o.code]

    await _paced(stub.HeartbeatBatchStream(), batch, len(members), window, out, refused)


async def _beat_stream(
    stub: registry_pb2_grpc.RegistryStub, i: int, lease: str, window: _Window, out: Any
) -> None:
    def beat() -> registry_pb2.HeartbeatRequest:
        return registry_pb2.HeartbeatRequest(
            instance_id=f"sim-{i:05d}", lease_id=lease, load=_load()
        )

    await _paced(stub.HeartbeatStream(), beat, 1, window, out)


async def _beat_unary(
    stub: registry_pb2_grpc.RegistryStub, i: int, lease: str, window: _Window, out: Any
) -> None:
    next_at = time.time() + random.random()
    while next_at < window.end:
        await asyncio.sleep(max(0.0, next_at - time.time()))
        if window.measured(next_at):
            out["late"].append((time.time() - next_at) * 1000)
        sent = time.perf_counter()
        request = registry_pb2.HeartbeatRequest(
            instance_id=f"sim-{i:05d}", lease_id=lease, load=_load()
        )
        try:
            await stub.Heartbeat(request, timeout=5)
            if window.measured(next_at):
                out["lat"].append((time.perf_counter() - sent) * 1000)
        except grpc.aio.AioRpcError as exc:
            _failed(out, exc.code().name, exc.details() or "")
        next_at += 1.0


async def _generate(args: argparse.Namespace) -> dict[str, Any]:
    ids = range(args.first, args.first + args.count)
    addresses = args.address.split(",")
    # Instance i talks to replica i % replicas (as clients listing the replicas in turn), over
    # one of the connections of `--per-connection` instances each (their own TCP connections:
    # instances are processes of their own; a few shared connections would let gRPC read many
    # heartbeats per system call, which a real fleet does not give the registry).
    per_connection = args.per_host if args.mode == "relay" else args.per_connection
    per_replica = (
        max(1, -(-args.count // (len(addresses) * per_connection))) if per_connection else 1
    )
    channels = [
        grpc_util.aio_channel(a, extra_options=[("grpc.use_local_subchannel_pool", 1)])
        for a in addresses
        for _ in range(per_replica)
    ]
    stubs = [registry_pb2_grpc.RegistryStub(c) for c in channels]
    gate = asyncio.Semaphore(_REGISTER_CONCURRENCY)
    out: dict[str, Any] = {"lat": [], "late": [], "errors": {}, "details": {}, "beats": 0}
    beat = _beat_stream if args.mode == "stream" else _beat_unary
    hosts: dict[int, list[tuple[int, str]]] = {}
    window = _Window()
    beating: list[asyncio.Task[None]] = []

    async def register(i: int) -> None:
        # Each instance heartbeats from its registration on (its lease must not lapse while
        # the others register); only the window's heartbeats are measured. A refused Register
        # is counted and tried again, as the client library does: an instance left out would
        # pass for a heartbeat the registry could not answer.
        stub = stubs[(i % len(addresses)) * per_replica + (i // len(addresses)) % per_replica]
        if args.mode == "relay":  # through its host's relay: the replica its host talks to
            stub = stubs[((i - args.first) // args.per_host) % len(stubs)]
        request = registry_pb2.RegisterRequest(spec=_spec(i), request_id=os.urandom(16).hex())
        for attempt in range(_REGISTER_ATTEMPTS):
            async with gate:
                try:
                    reply = await stub.Register(request, timeout=_REGISTER_TIMEOUT_S)
                    break
                except grpc.aio.AioRpcError as exc:  # counted; the others go on
                    _failed(out, f"Register {exc.code().name}", exc.details() or "")
            await asyncio.sleep(0.5 * (attempt + 1))
        else:
            return
        if args.mode == "relay":  # a host's instances are consecutive and share its connection
            host = (i - args.first) // args.per_host
            members = hosts.setdefault(host, [])
            members.append((i, reply.lease_id))
            # The host beats from its last member's registration on (no lease may lapse).
            if len(members) == min(args.per_host, args.count - host * args.per_host):
                host_stub = stubs[host % len(stubs)]
                beating.append(asyncio.create_task(_beat_host(host_stub, members, window, out)))
            return
        beating.append(asyncio.create_task(beat(stub, i, str(reply.lease_id), window, out)))

    await asyncio.gather(*(register(i) for i in ids))
    print("registered", flush=True)  # the parent starts the clock for everyone at once
    window.start = float(await asyncio.to_thread(sys.stdin.readline))
    window.end = window.start + args.duration_s
    await asyncio.gather(*beating)
    for chan in channels:
        await chan.close()
    return out


# ------------------------------------------------------------------- watcher (child process)


def _watch(args: argparse.Namespace) -> dict[str, Any]:
    """Reads one watch stream for the window; fan-out latency of every heartbeat's event."""
    lat: list[float] = []
    removed = 0
    with grpc_util.channel(args.address.split(",")[0]) as chan:
        call = registry_pb2_grpc.RegistryStub(chan).WatchInstances(
            registry_pb2.WatchInstancesRequest(max_batch=256)
        )
        print("watching", flush=True)
        start = float(sys.stdin.readline())
        end = start + args.duration_s
        threading.Timer(max(0.0, end - time.time()) + 2.0, call.cancel).start()
        with contextlib.suppress(grpc.RpcError):
            for message in call:
                now_us = time.time_ns() // 1000
                events = message.events if message.type == _Ev.BATCH else [message]
                for event in events:
                    removed += event.type == _Ev.REMOVED
                    sent_us = event.instance.load.recv_buffer_headroom_bytes
                    if event.type == _Ev.UPDATED and sent_us and start <= sent_us / 1e6 <= end:
                        lat.append((now_us - sent_us) / 1000)
    return {"lat": lat, "removed": removed}


# ----------------------------------------------------------------------- orchestration (parent)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime + stime


def _proposals(cluster: EtcdCluster | None) -> float:
    """Raft proposals committed, summed over the members (etcd's /metrics)."""
    if cluster is None:
        return 0.0
    total = 0.0
    for member in cluster.members:
        with urllib.request.urlopen(f"{member.client_url}/metrics", timeout=5) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith("etcd_server_proposals_committed_total "):
                    total = max(total, float(line.split()[1]))  # the same on every member
    return total


def _child(command: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _pinned(argv: list[str], cpus: set[int] | None) -> list[str]:
    """`argv` (a Python command) run on `cpus` only, every thread of it (the affinity is set
    before its interpreter starts and is inherited); None: anywhere."""
    if not cpus:
        return argv
    cpu_set = ", ".join(map(str, sorted(cpus)))
    pin = (
        f"import os, sys; os.sched_setaffinity(0, {{{cpu_set}}}); "
        "os.execv(sys.executable, sys.argv[1:])"
    )
    return [sys.executable, "-c", pin, *argv]


def _pin_running(cluster: EtcdCluster, cpus: set[int] | None) -> None:
    """Moves every thread of the cluster's members to `cpus` (None: left where they are): etcd
    is the store, not the registry, and must not take the registry's CPUs."""
    if not cpus:
        return
    for member in cluster.members:
        pid = member.process.pid if member.process else None
        if not pid:
            continue
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                os.sched_setaffinity(int(task.name), cpus)


def _run_one(store: str, mode: str, n: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    head = {"store": store, "mode": mode, "n": n, "replicas": args.replicas}
    cluster: EtcdCluster | None = None
    registries: list[ManagedProcess] = []
    relay: ManagedProcess | None = None
    children: list[subprocess.Popen[str]] = []
    try:
        flags = ["--log-level", "WARNING", "--lease-ttl-ms", str(args.lease_ttl_ms)]
        if store == "etcd":
            cluster = EtcdCluster(Path(tempfile.mkdtemp(dir=root)), size=args.etcd_members)
            cluster.start()
            _pin_running(cluster, args.load_cpus)
            flags += ["--store", "etcd", "--etcd-endpoints", cluster.endpoints]
        addresses = []
        for r in range(args.replicas if store == "etcd" else 1):
            port = free_port_run()
            argv = [sys.executable, "-m", "pdplane.cli.main", "registry", "--port", str(port)]
            argv = _pinned(argv + flags, args.registry_cpus)
            registries.append(ManagedProcess(f"registry-{r}", argv, root / f"reg{r}.log"))
            registries[-1].start()
            addresses.append(f"127.0.0.1:{port}")
        for address, proc in zip(addresses, registries, strict=True):
            wait_until(functools.partial(grpc_serving, address), 30, watch=[proc])
        target = ",".join(addresses)
        common = [sys.executable, __file__, "--duration-s", str(args.duration_s)]
        watcher = _child(_pinned([*common, "--address", target, "--watch-child"], args.load_cpus))
        if args.through_relay:  # the instances' streams end at one relay, on the load's CPUs
            port = free_port_run()
            argv = [sys.executable, "-m", "pdplane.cli.main", "registry-relay", "--port"]
            argv += [str(port), "--registry", target, "--log-level", "WARNING"]
            relay = ManagedProcess("relay", _pinned(argv, args.load_cpus), root / "relay.log")
            relay.start()
            wait_until(functools.partial(grpc_serving, f"127.0.0.1:{port}"), 30, watch=[relay])
            target = f"127.0.0.1:{port}"
        common += ["--address", target]
        assert watcher.stdout is not None
        if watcher.stdout.readline().strip() != "watching":
            return {**head, "failed": "watcher did not start"}
        share = -(-n // args.clients)
        for first in range(0, n, share):
            count = min(share, n - first)
            command = [*common, "--generate", "--first", str(first), "--count", str(count)]
            command += ["--per-connection", str(args.per_connection)]
            children.append(_child(_pinned([*command, "--mode", mode], args.load_cpus)))
        for gen in children:
            assert gen.stdout is not None
            if gen.stdout.readline().strip() != "registered":
                tails = " | ".join(p.tail(5).replace("\n", " / ") for p in registries)
                return {**head, "failed": f"registration did not complete; registry: {tails}"}
        start = time.time() + 1.0
        for child in [watcher, *children]:
            assert child.stdin is not None
            child.stdin.write(f"{start}\n")
            child.stdin.flush()
        time.sleep(max(0.0, start - time.time()))
        relay_pid = relay.pid if relay is not None else None
        pids = [p.pid for p in registries if p.pid]
        etcd_pids = (
            [m.process.pid for m in cluster.members if m.process and m.process.pid]
            if cluster
            else []
        )
        relay0 = _cpu_seconds(relay_pid) if relay_pid else 0.0
        cpu0 = sum(_cpu_seconds(p) for p in pids)
        etcd0, props0 = sum(_cpu_seconds(p) for p in etcd_pids), _proposals(cluster)
        time.sleep(args.duration_s)
        cpu = sum(_cpu_seconds(p) for p in pids) - cpu0
        relay_cpu = _cpu_seconds(relay_pid) - relay0 if relay_pid else None
        etcd_cpu = sum(_cpu_seconds(p) for p in etcd_pids) - etcd0
        props = _proposals(cluster) - props0
        results = [json.loads(gen.communicate(timeout=180)[0]) for gen in children]
        watched = json.loads(watcher.communicate(timeout=60)[0])
    finally:
        for child in [*children]:
            if child.poll() is None:
                child.kill()
        for proc in [*registries, *([relay] if relay is not None else [])]:
            proc.stop(grace_s=10)
        if cluster is not None:
            cluster.stop()
            shutil.rmtree(cluster.data_dir, ignore_errors=True)
    lat = [x for r in results for x in r["lat"]]
    late = [x for r in results for x in r["late"]]
    errors: dict[str, int] = {}
    for r in results:
        for code, count in r["errors"].items():
            errors[code] = errors.get(code, 0) + count
    beats = sum(r["beats"] for r in results) if mode != "unary" else len(lat)
    return {
        **head,
        "achieved_hb_s": round(beats / args.duration_s, 1),
        "p50_ms": round(percentile(lat, 50), 2),
        "p99_ms": round(percentile(lat, 99), 2),
        "registry_cpu_pct": round(100 * cpu / args.duration_s, 1),
        "registry_us_per_hb": round(1e6 * cpu / beats, 1) if beats else None,
        "etcd_cpu_pct": round(100 * etcd_cpu / args.duration_s, 1),
        "etcd_writes_s": round(props / args.duration_s, 1),
        "fanout_p50_ms": round(percentile(watched["lat"], 50), 1),
        "fanout_p99_ms": round(percentile(watched["lat"], 99), 1),
        "lost_instances": watched["removed"],
        "errors": errors,
        "error_details": {k: v for r in results for k, v in r.get("details", {}).items()},
        "generator_late_p99_ms": round(percentile(late, 99), 1),
        "relay_cpu_pct": None if relay_cpu is None else round(100 * relay_cpu / args.duration_s, 1),
        "loadavg_1m": round(os.getloadavg()[0], 1),
    }


_HEADER = (
    "store  mode    rep      N   hb/s achieved   p50ms   p99ms  reg%1c us/hb etcd%1c etcdW/s "
    "fanout50 fanout99 lost late99 load1 errors"
)


def _row(r: dict[str, Any]) -> str:
    head = f"{r['store']:<6} {r['mode']:<6} {r['replicas']:>3} {r['n']:>6} "
    if "failed" in r:
        return head + "FAILED: " + r["failed"]
    return head + (
        f"{r['achieved_hb_s']:>9}/{r['n']:<6} {r['p50_ms']:>7} {r['p99_ms']:>7} "
        f"{r['registry_cpu_pct']:>7} {r['registry_us_per_hb']:>5} {r['etcd_cpu_pct']:>7} "
        f"{r['etcd_writes_s']:>7} {r['fanout_p50_ms']:>8} {r['fanout_p99_ms']:>8} "
        f"{r['lost_instances']:>4} {r['generator_late_p99_ms']:>6} {r['loadavg_1m']:>5} "
        f"{r['errors'] or ''}"
        + (f" relay {r['relay_cpu_pct']} %1c" if r.get("relay_cpu_pct") is not None else "")
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", default="1000,10000", help="instance counts, comma-separated")
    parser.add_argument("--store", default="memory,etcd", help="memory, etcd or both")
    parser.add_argument(
        "--mode", default="stream", help="stream, unary, relay (see --per-host) or a list"
    )
    parser.add_argument(
        "--per-host",
        type=int,
        default=8,
        help="--mode relay: instances per host (one relay, one connection and one batch a "
        "second each)",
    )
    parser.add_argument("--duration-s", type=float, default=15.0, help="heartbeat window (s)")
    parser.add_argument("--clients", type=int, default=4, help="load-generator processes")
    parser.add_argument("--replicas", type=int, default=1, help="registry replicas (etcd store)")
    parser.add_argument(
        "--per-connection",
        type=int,
        default=0,
        help="instances sharing one connection of a generator (each its own TCP connection; "
        "0: one connection per generator and replica)",
    )
    parser.add_argument(
        "--through-relay",
        action="store_true",
        help="stream/unary modes: the instances talk to one `pdplane registry-relay` (on the "
        "load's CPUs) in front of the registry; its CPU is printed at the end of the row",
    )
    parser.add_argument("--etcd-members", type=int, default=1, help="etcd cluster size")
    parser.add_argument("--lease-ttl-ms", type=int, default=5000, help="instances' lease TTL")
    parser.add_argument(
        "--registry-cpus",
        help="pin the registry processes to these CPUs, e.g. 0,1; the load generators and "
        "the watcher then run on the others",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per run")
    parser.add_argument("--generate", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--watch-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.load_cpus = None
    if args.registry_cpus:
        args.registry_cpus = {int(c) for c in args.registry_cpus.split(",")}
        args.load_cpus = os.sched_getaffinity(0) - args.registry_cpus
    if args.generate:
        print(json.dumps(asyncio.run(_generate(args))), flush=True)
        return 0
    if args.watch_child:
        print(json.dumps(_watch(args)), flush=True)
        return 0
    shm = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(prefix="pdplane-bench-", dir=shm if shm.is_dir() else None))
    pinned = (
        f", registry on CPUs {sorted(args.registry_cpus)}, load on {len(args.load_cpus)} others"
        if args.registry_cpus
        else ""
    )
    print(
        f"cores: {os.cpu_count()}, window {args.duration_s:.0f} s, {args.clients} generator(s), "
        f"etcd members: {args.etcd_members}{pinned}"
    )
    print(_HEADER)
    try:
        for store in args.store.split(","):
            for mode in args.mode.split(","):
                for n in (int(x) for x in args.n.split(",")):
                    result = _run_one(store, mode, n, args, root)
                    print(json.dumps(result) if args.json else _row(result), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
