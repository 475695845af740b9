"""Real registration with the registry, and `pdplane sim` as a process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import grpc
import httpx

from pdplane.registry.server import RegistryServer
from pdplane.registry.settings import RegistrySettings
from pdplane.sim.testing import running_sims
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from tests.integration.sim.helpers import wait_for


def test_sims_register_heartbeat_load_and_deregister() -> None:
    registry = RegistryServer(RegistrySettings(port=0, heartbeat_interval_ms=50))
    registry.start()
    try:
        with grpc.insecure_channel(registry.address) as channel:
            stub = registry_pb2_grpc.RegistryStub(channel)

            def listed() -> list[instance_pb2.Instance]:
                request = registry_pb2.ListInstancesRequest()
                return list(stub.ListInstances(request, timeout=5).instances)

            with running_sims(["prefill", "decode"], registry=registry.address, itl_ms=20) as sims:
                got = wait_for(
                    lambda: (
                        [i for i in listed() if i.load.total_kv_blocks] == listed()
                        and len(listed()) == 2
                        and listed()
                    ),
                    timeout=10,
                )
                by_id = {i.spec.instance_id: i for i in got}
                p = by_id[sims[0].instance_id]
                assert p.spec.role == instance_pb2.ROLE_PREFILL
                assert p.spec.url == sims[0].url and p.spec.kv_endpoint == sims[0].kv_endpoint
                assert p.load.total_kv_blocks == 8192
                body = {"prompt": "a", "max_tokens": 100, "stream": True}
                with httpx.stream("POST", sims[1].url + "/v1/completions", json=body) as r:
                    chunks = r.iter_bytes()
                    next(chunks)

                    def decode_busy() -> bool:
                        d = {i.spec.instance_id: i for i in listed()}[sims[1].instance_id]
                        return d.load.num_running == 1 and d.load.kv_cache_usage > 0

                    wait_for(decode_busy, timeout=10)
            assert listed() == []
    finally:
        registry.stop()


def test_cli_hosts_several_instances_and_stops_on_sigterm() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdplane.cli.main",
            "sim",
            "--role",
            "decode",
            "--port",
            "0",
            "--instances",
            "3",
            "--itl-ms",
            "1",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = [json.loads(proc.stdout.readline()) for _ in range(3)]
        assert len({line["url"] for line in lines}) == 3
        for line in lines:
            assert httpx.get(line["url"] + "/health", timeout=5).status_code == 200
            assert line["role"] == "decode"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
