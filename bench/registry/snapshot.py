"""A registry holding 5,000 large specs: snapshot message sizes, list parts, RSS, and RSS once
every lease expired.

    python bench/registry/snapshot.py [--instances 5000] [--spec-bytes 7800]

Starts `python -m pdplane.registry` (memory store) on a free loopback port,
registers `--instances` specs of about `--spec-bytes` serialized bytes (labels fill them up)
with a 5 s lease and no heartbeats, then reads one chunked WatchInstances snapshot, one
ListInstancesStream and one ListInstances, and prints the registry's RSS (VmRSS, MB) before,
after registering, after the reads and after the leases expired.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent import futures

import grpc

from pdplane.core.grpc import util as grpc_util
from pdplane.launch.ports import free_port_run
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _spec(i: int, size: int) -> instance_pb2.InstanceSpec:
    spec = instance_pb2.InstanceSpec(
        instance_id=f"big-{i:05d}",
        role=instance_pb2.ROLE_DECODE if i % 2 else instance_pb2.ROLE_PREFILL,
        model="bench-model",
        url=f"http://10.0.{i // 250}.{i % 250 + 1}:8000",
        kv_endpoint=f"10.0.{i // 250}.{i % 250 + 1}:50100",
        transport=instance_pb2.TRANSPORT_TCP,
        tp_size=1,
        kv_layout=instance_pb2.KvLayout(
            num_layers=32, num_kv_heads=8, head_size=128, block_size=16, dtype="bfloat16"
        ),
        max_model_len=8192,
    )
    j = 0
    while spec.ByteSize() + 270 < size and j < 64:
        spec.labels[f"bench/k{j}"] = chr(97 + (i + j) % 26) * 250
        j += 1
    return spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=5000)
    parser.add_argument("--spec-bytes", type=int, default=7800)
    args = parser.parse_args()
    port = free_port_run()
    env = {**os.environ, "PDPLANE_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdplane.registry", "--port", str(port), "--host", "127.0.0.1"],
        env=env,
    )
    address = f"127.0.0.1:{port}"
    try:
        channel = grpc_util.channel(address)
        grpc.channel_ready_future(channel).result(timeout=30)
        stub = registry_pb2_grpc.RegistryStub(channel)
        print(f"registry RSS at start: {_rss_mb(proc.pid):.0f} MB")
        specs = [_spec(i, args.spec_bytes) for i in range(args.instances)]
        total = sum(s.ByteSize() for s in specs)
        print(f"{len(specs)} specs of {specs[0].ByteSize()} bytes, {total / 1e6:.1f} MB in all")
        with futures.ThreadPoolExecutor(8) as pool:
            list(
                pool.map(
                    lambda s: stub.Register(
                        registry_pb2.RegisterRequest(spec=s, lease_ttl_ms=5000), timeout=30
                    ),
                    specs,
                )
            )
        registered_at = time.monotonic()
        print(f"registry RSS after registering: {_rss_mb(proc.pid):.0f} MB")

        parts = []
        call = stub.WatchInstances(
            registry_pb2.WatchInstancesRequest(chunked_snapshots=True), timeout=60
        )
        for event in call:
            parts.append(event.ByteSize())
            if not event.more:
                break
        call.cancel()
        print(
            f"WatchInstances snapshot: {len(parts)} part(s), largest {max(parts) / 1e6:.2f} MB,"
            f" {sum(parts) / 1e6:.1f} MB in all"
        )
        listed = [
            r.ByteSize()
            for r in stub.ListInstancesStream(registry_pb2.ListInstancesRequest(), timeout=60)
        ]
        print(f"ListInstancesStream: {len(listed)} message(s), largest {max(listed) / 1e6:.2f} MB")
        try:
            one = stub.ListInstances(registry_pb2.ListInstancesRequest(), timeout=60)
            print(f"ListInstances: one message of {one.ByteSize() / 1e6:.1f} MB")
        except grpc.RpcError as exc:
            print(f"ListInstances: {exc.code().name}")  # type: ignore[attr-defined]
        print(f"registry RSS after the reads: {_rss_mb(proc.pid):.0f} MB")

        while stub.ListInstances(registry_pb2.ListInstancesRequest(), timeout=60).instances:
            time.sleep(0.5)
        expired_after = time.monotonic() - registered_at
        time.sleep(2.0)
        print(
            f"registry RSS {expired_after:.1f} s after registering, every lease expired:"
            f" {_rss_mb(proc.pid):.0f} MB"
        )
        channel.close()
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
