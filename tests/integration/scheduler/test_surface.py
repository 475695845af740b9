"""The scheduler as a service: bad input, auth, health, reflection, metrics, the CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdplane.launch.ports import free_port_run
from pdplane.scheduler import RequestFeatures, SchedulerError, SchedulerUnavailable
from pdplane.scheduler.remote import RemoteScheduler
from pdplane.scheduler.server import SchedulerServer
from pdplane.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.integration.registry.fixtures import running_registry
from tests.integration.scheduler.conftest import Fleet, sees, wait_for
from tests.integration.scheduler.fixtures import running_scheduler_server


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        ({"request_id": ""}, "request_id: must not be empty"),
        ({"model": ""}, "model: must not be empty"),
        ({"prompt_tokens": 0}, "prompt_tokens: must be > 0"),
        ({"prefill_policy": "fastest"}, "prefill_policy: unknown policy 'fastest'"),
        ({"decode_policy": "x"}, "decode_policy: unknown policy 'x'"),
        (
            {
                "prefix_hashes": [
                    scheduler_pb2.PrefixHashes(block_size=4, block_hashes=[1, 2, 3], hash_version=1)
                ]
            },
            "prefix_hashes: 3 blocks of 4 tokens exceed prompt_tokens=10",
        ),
    ],
)
def test_bad_requests_are_invalid_argument(
    pair_server: Callable[..., SchedulerServer], request_fields: dict, message: str
) -> None:
    server = pair_server()
    fields = {"request_id": "r", "model": "tiny", "prompt_tokens": 10, **request_fields}
    with grpc.insecure_channel(server.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Schedule(scheduler_pb2.ScheduleRequest(**fields), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


async def test_client_rejects_negative_lengths_and_maps_invalid_argument(
    pair_server: Callable[..., SchedulerServer], client_factory: Callable[..., RemoteScheduler]
) -> None:
    client = client_factory(pair_server().address)
    with pytest.raises(ValueError, match="prompt_tokens must be between 0 and"):
        await client.schedule(RequestFeatures("r", "tiny", -1))
    with pytest.raises(ValueError, match="max_tokens must be between 0 and"):
        await client.schedule(RequestFeatures("r", "tiny", 10, -3))
    with pytest.raises(ValueError, match="prompt_tokens: must be > 0"):
        await client.schedule(RequestFeatures("r", "tiny", 0))


async def test_token_is_required_and_probes_stay_open(
    pair_server: Callable[..., SchedulerServer], client_factory: Callable[..., RemoteScheduler]
) -> None:
    server = pair_server(token="s3cret")
    with pytest.raises(SchedulerError) as err:
        await client_factory(server.address).schedule(RequestFeatures("r", "tiny", 10))
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    ok = await client_factory(server.address, token="s3cret").schedule(
        RequestFeatures("r", "tiny", 10)
    )
    assert ok.prefill.instance_id == "p0"
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        response = health.Check(health_pb2.HealthCheckRequest(service="pdplane.v1.Scheduler"))
        assert response.status == health_pb2.HealthCheckResponse.SERVING


async def test_tls_towards_callers_and_the_registry(
    tls_files: tuple[Path, Path], client_factory: Callable[..., RemoteScheduler]
) -> None:
    cert, key = (str(p) for p in tls_files)
    with running_registry(tls_cert=cert, tls_key=key) as registry:
        fleet = Fleet(registry, tls_ca=cert)
        try:
            fleet.add("p0", "prefill")
            fleet.add("d0", "decode")
            with running_scheduler_server(
                registry, tls_ca=cert, tls_cert=cert, tls_key=key
            ) as server:
                wait_for(sees(server, "p0", "d0"), what="the view over TLS")
                client = client_factory(server.address, tls_ca=cert)
                assert (
                    await client.schedule(RequestFeatures("r", "tiny", 10))
                ).decode.instance_id == "d0"
                with pytest.raises(SchedulerUnavailable):  # plaintext to a TLS port
                    await client_factory(server.address, timeout_s=2).schedule(
                        RequestFeatures("r2", "tiny", 10)
                    )
        finally:
            fleet.close()


async def test_unreachable_scheduler_is_unavailable(
    client_factory: Callable[..., RemoteScheduler],
) -> None:
    client = client_factory(f"127.0.0.1:{free_port_run()}", timeout_s=2.0)
    started = time.monotonic()
    with pytest.raises(SchedulerUnavailable):
        await client.schedule(RequestFeatures("r", "tiny", 10))
    assert time.monotonic() - started < 2.5


async def test_metrics_are_served(
    pair_server: Callable[..., SchedulerServer],
    client_factory: Callable[..., RemoteScheduler],
) -> None:
    server = pair_server(metrics_port=free_port_run())
    client = client_factory(server.address)
    await client.schedule(RequestFeatures("r1", "tiny", 10))
    with pytest.raises(SchedulerUnavailable):
        await client.schedule(RequestFeatures("r2", "other-model", 10))
    url = f"http://127.0.0.1:{server.app.metrics_port}/metrics"
    async with httpx.AsyncClient() as http:
        text = (await http.get(url, timeout=5)).text
    assert (
        'pdplane_scheduler_decisions_total{decode_policy="kv_aware",'
        'prefill_policy="kv_aware"} 1.0' in text
    )
    assert 'pdplane_scheduler_unavailable_total{side="prefill"} 1.0' in text
    assert 'pdplane_scheduler_inflight_requests{instance_id="d0"} 1.0' in text
    assert "pdplane_scheduler_decision_seconds_bucket" in text


def test_cli_serves_until_sigterm(registry: str, fleet: Fleet) -> None:
    fleet.add("p0", "prefill")
    fleet.add("d0", "decode")
    port = free_port_run()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDPLANE_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdplane.cli.main", "scheduler", "--registry", registry,
         "--port", str(port), "--prefill-policy", "round_robin"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            request = scheduler_pb2.ScheduleRequest(request_id="r", model="tiny", prompt_tokens=9)

            def schedules() -> bool:
                try:
                    return stub.Schedule(request, timeout=1).decode.instance_id == "d0"
                except grpc.RpcError:
                    return False

            wait_for(schedules, timeout=30, what="the CLI scheduler to pair p0/d0")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "prefill round_robin" in out


def test_cli_rejects_an_unknown_policy() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdplane.cli.main", "scheduler", "--registry", "127.0.0.1:1",
         "--decode-policy", "fastest"],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "unknown policy 'fastest'" in result.stderr
