"""`pdplane registry --workers N`: worker processes sharing the port, heartbeats handed to the
store process in batches. (The rest of this folder runs every registry test through two workers
too: the `workers` parameter.)"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdplane.core.grpc import util as grpc_util
from pdplane.launch.ports import free_port_run
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from tests.integration.registry.conftest import wait_until
from tests.integration.registry.fixtures import make_spec, running_registry_server

PDPLANE = [sys.executable, "-m", "pdplane.cli.main"]


@pytest.fixture(autouse=True)
def once(request: pytest.FixtureRequest) -> None:
    """These tests start their own workers: run them once, not once per store."""
    if request.node.callspec.params.get("registry_store") != "workers":
        pytest.skip("runs once, with the workers parameter")


def _children(pid: int) -> list[int]:
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.fixture
def registry_command(
    tmp_path: Path,
) -> Iterator[tuple[subprocess.Popen[str], str, list[int]]]:
    """`pdplane registry --workers 2` as a process (its temporary folder in `tmp_path`):
    (process, address, worker pids) once it serves."""
    port = free_port_run()
    proc = subprocess.Popen(
        [*PDPLANE, "registry", "--port", str(port), "--workers", "2", "--token", "t"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    address = f"127.0.0.1:{port}"
    try:
        assert wait_until(lambda: len(_children(proc.pid)) == 2 and _serving(address), 30, 0.1)
        yield proc, address, _children(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def _serving(address: str) -> bool:
    with grpc_util.channel(address) as chan:
        try:
            registry_pb2_grpc.RegistryStub(chan).ListInstances(
                registry_pb2.ListInstancesRequest(),
                metadata=grpc_util.token_metadata("t"),
                timeout=1,
            )
        except grpc.RpcError:
            return False
    return True


def test_sigterm_stops_the_workers_and_leaves_no_socket_folder(
    registry_command: tuple[subprocess.Popen[str], str, list[int]], tmp_path: Path
) -> None:
    proc, _, workers = registry_command
    assert list(tmp_path.glob("pdplane-registry-*"))  # the store's private socket folder
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert not any(_alive(pid) for pid in workers)
    assert not list(tmp_path.glob("pdplane-registry-*"))


def test_workers_leave_when_the_registry_process_is_killed(
    registry_command: tuple[subprocess.Popen[str], str, list[int]],
) -> None:
    proc, _, workers = registry_command
    proc.kill()
    proc.wait(timeout=10)
    # Bounded: each worker looks for its parent every 0.5 s.
    assert wait_until(lambda: not any(_alive(pid) for pid in workers), 10, 0.1)


async def _beat_all(address: str, leases: dict[str, str]) -> dict[str, object]:
    """One HeartbeatStream per instance, all at once; each instance's answer (the state its
    reply gives, or its status code)."""
    async with grpc_util.aio_channel(address) as chan:
        stub = registry_pb2_grpc.RegistryStub(chan)

        async def one(instance_id: str, lease: str) -> object:
            call = stub.HeartbeatStream()
            await call.write(registry_pb2.HeartbeatRequest(instance_id=instance_id, lease_id=lease))
            try:
                reply = await call.read()
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            if reply is grpc.aio.EOF:
                return await call.code()
            await call.done_writing()
            return reply.state

        answers = await asyncio.gather(*(one(i, lease) for i, lease in leases.items()))
    return dict(zip(leases, answers, strict=True))


def test_heartbeats_answered_together_each_get_their_own_answer() -> None:
    with running_registry_server(workers=2) as registry:
        store = registry.store
        leases = {f"p{i}": store.register(make_spec(f"p{i}"), 60_000).lease_id for i in range(60)}
        for i in range(0, 60, 3):
            store.deregister(f"p{i}", leases[f"p{i}"], drain=True)
        leases["p7"] = "not-p7s-lease"
        leases["gone"] = "no-such-lease"
        answers = asyncio.run(_beat_all(registry.address, leases))
        expected: dict[str, object] = {
            f"p{i}": instance_pb2.INSTANCE_STATE_DRAINING
            if i % 3 == 0
            else instance_pb2.INSTANCE_STATE_SERVING
            for i in range(60)
        }
        expected["p7"] = expected["gone"] = grpc.StatusCode.NOT_FOUND
        assert answers == expected
