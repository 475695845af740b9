"""`pdplane ls` (table, --json, --role, --watch) and `pdplane registry` as real processes."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdplane.core.grpc import util as grpc_util
from pdplane.launch.ports import free_port_run
from pdplane.registry.server import RegistryServer
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from tests.integration.registry.conftest import wait_until
from tests.integration.registry.fixtures import make_spec, running_registry_server
from tests.support.signals import other_threads, signal_thread

PDPLANE = [sys.executable, "-m", "pdplane.cli.main"]


def _pdplane(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PDPLANE, *args], capture_output=True, text=True, timeout=30, env={**os.environ, **env}
    )


@pytest.fixture
def populated(registry: RegistryServer) -> Iterator[RegistryServer]:
    """p0 (prefill, loaded), d0 (decode, draining), b0 (both, model "big"), by lease TTL 60 s."""
    store = registry.store
    p0 = store.register(make_spec("p0"), 60_000)
    load = instance_pb2.LoadReport(num_running=2, num_waiting=1, kv_cache_usage=0.25)
    store.heartbeat("p0", p0.lease_id, load)
    d0 = store.register(make_spec("d0", instance_pb2.ROLE_DECODE), 60_000)
    store.deregister("d0", d0.lease_id, drain=True)
    store.register(make_spec("b0", instance_pb2.ROLE_BOTH, model="big"), 60_000)
    yield registry


def test_ls_json(populated: RegistryServer) -> None:
    result = _pdplane("ls", "--registry", populated.address, "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["id"] for r in rows] == ["b0", "d0", "p0"]
    p0 = rows[2]
    assert {k: p0[k] for k in ("role", "model", "url", "kv_endpoint", "state")} == {
        "role": "prefill",
        "model": "tiny",
        "url": "http://127.0.0.1:8100",
        "kv_endpoint": "127.0.0.1:50100",
        "state": "serving",
    }
    assert p0["load"]["num_running"] == 2 and p0["load"]["kv_cache_usage"] == 0.25
    assert p0["kv_layout"] == "L2.H2.D32.B16.float32"
    assert rows[1]["state"] == "draining"


def test_ls_filters_and_table(populated: RegistryServer) -> None:
    decode = json.loads(
        _pdplane("ls", "--registry", populated.address, "--json", "--role", "decode").stdout
    )
    assert [r["id"] for r in decode] == ["b0", "d0"]  # BOTH serves decode too
    # The registry address from the environment this time (every flag has a PDPLANE_* twin).
    big = json.loads(
        _pdplane("ls", "--json", "--model", "big", PDPLANE_REGISTRY=populated.address).stdout
    )
    assert [r["id"] for r in big] == ["b0"]
    table = _pdplane("ls", "--registry", populated.address, "--scheduler", "").stdout.splitlines()
    assert table[0].split()[:4] == ["ID", "ROLE", "MODEL", "STATE"]
    assert [line.split()[0] for line in table[1:]] == ["b0", "d0", "p0"]
    assert table[3].split()[6:9] == ["2", "1", "25"]  # RUN WAIT KV%


def test_ls_errors(registry: RegistryServer) -> None:
    down = _pdplane("ls", "--registry", f"127.0.0.1:{free_port_run()}", "--timeout-s", "1")
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr
    a, b = f"127.0.0.1:{free_port_run()}", f"127.0.0.1:{free_port_run()}"
    for flags in ([], ["--watch"]):
        both = _pdplane("ls", "--registry", f"{a},{b}", "--timeout-s", "1", *flags)
        assert both.returncode == 1 and f"every registry replica ({a}, {b})" in both.stderr
    bad = _pdplane("ls", "--registry", registry.address, "--role", "middle")
    assert bad.returncode == 2 and "--role" in bad.stderr


class _Watch:
    """`pdplane ls --watch --json` on `address` as a process: its stdout lines as they come
    (`next`), its stderr once it ended (`stop`)."""

    def __init__(self, address: str) -> None:
        self.proc = subprocess.Popen(
            [*PDPLANE, "ls", "--registry", address, "--watch", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout or ():
            self._lines.put(line)

    def next(self, timeout_s: float) -> dict[str, Any]:
        """The next event (raises queue.Empty after `timeout_s`)."""
        event: dict[str, Any] = json.loads(self._lines.get(timeout=timeout_s))
        return event

    def stop(self) -> str:
        """SIGINT; asserts exit code 0; returns what it wrote on stderr."""
        self.proc.send_signal(signal.SIGINT)
        # A bound on the exit, not a pause: under a fully loaded 2-core machine the
        # interpreter's teardown (gRPC's threads, the channel) took over 10 s once.
        assert self.proc.wait(timeout=60) == 0
        self._reader.join(timeout=5)
        return self.proc.stderr.read() if self.proc.stderr else ""


def test_ls_watch_streams_events(registry: RegistryServer) -> None:
    watch = _Watch(registry.address)
    try:
        assert watch.next(20)["type"] == "SNAPSHOT"
        # A lease far longer than the fixture's 1 s default: nothing heartbeats it here, and on
        # a loaded machine it must not expire before the test deregisters it.
        lease = registry.store.register(make_spec("p9"), 30_000)
        added = watch.next(10)
        assert (added["type"], added["instance"]["id"]) == ("ADDED", "p9")
        registry.store.deregister("p9", lease.lease_id, drain=False)
        removed = watch.next(10)
        assert (removed["type"], removed["reason"]) == ("REMOVED", "deregistered")
        assert removed["revision"] > added["revision"]
    finally:
        watch.stop()


def test_ls_watch_follows_its_one_registry_through_a_restart() -> None:
    # A registry restarted (an upgrade, a crash) under a watch that was following it: the
    # watch says so on stderr, reconnects, and goes on from the new registry's snapshot.
    port = free_port_run()
    with running_registry_server(port) as first:
        watch = _Watch(first.address)
        try:
            assert watch.next(20)["type"] == "SNAPSHOT"
        except BaseException:
            watch.proc.kill()
            raise
    with running_registry_server(port) as second:
        try:
            again = watch.next(30)
            assert (again["type"], again.get("instances", [])) == ("SNAPSHOT", [])
            second.store.register(make_spec("p9"), 30_000)
            added = watch.next(10)
            assert (added["type"], added["instance"]["id"]) == ("ADDED", "p9")
        finally:
            stderr = watch.stop()
    assert stderr.count(f"registry {second.address} broke off") == 1, stderr
    assert stderr.count(f"registry {second.address} answers again") == 1, stderr


def test_registry_command_serves_and_stops_on_sigterm() -> None:
    port = free_port_run()
    proc = subprocess.Popen(
        [
            *PDPLANE,
            "registry",
            "--port",
            str(port),
            "--heartbeat-interval-ms",
            "500",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PDPLANE_LEASE_TTL_MS": "2000"},
    )
    address = f"127.0.0.1:{port}"
    try:
        with grpc_util.channel(address) as chan:
            health = health_pb2_grpc.HealthStub(chan)

            def serving() -> bool:
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                except grpc.RpcError:
                    return False
                return reply.status == health_pb2.HealthCheckResponse.SERVING

            assert wait_until(serving, 20, interval=0.1)
            stub = registry_pb2_grpc.RegistryStub(chan)
            grant = stub.Register(registry_pb2.RegisterRequest(spec=make_spec()), timeout=5)
            assert (grant.lease_ttl_ms, grant.heartbeat_interval_ms) == (2000, 500)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


def test_registry_command_stops_on_a_sigterm_taken_by_a_grpc_thread() -> None:
    port = free_port_run()
    proc = subprocess.Popen([*PDPLANE, "registry", "--port", str(port)], stderr=subprocess.PIPE)
    try:
        with grpc_util.channel(f"127.0.0.1:{port}") as chan:
            stub = registry_pb2_grpc.RegistryStub(chan)
            stub.ListInstances(registry_pb2.ListInstancesRequest(), timeout=20, wait_for_ready=True)
        signal_thread(proc.pid, other_threads(proc.pid)[-1], signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()


def test_registry_command_rejects_bad_flags() -> None:
    result = _pdplane("registry", "--port", "70000")
    assert result.returncode == 2 and "--port" in result.stderr
    result = _pdplane("registry", "--tls-cert", "only-cert.pem")
    assert result.returncode == 2 and "tls" in result.stderr


def test_registry_command_reports_a_busy_port(registry: RegistryServer) -> None:
    # Bad input, as for a bad flag: status 2 and one line naming the address and the flag.
    result = _pdplane("registry", "--port", str(registry.port))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"pdplane registry: address already in use: 127.0.0.1:{registry.port} (--port); "
        "stop the process listening there or choose another port (--port)"
    )
