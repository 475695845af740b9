"""Memory a caller can make the registry hold, measured on `pdplane registry` in its own process.

Unauthenticated unary calls used to be refused only after their whole request (up to the 64 MiB
message limit) was received: 8 concurrent 60 MiB Register calls without a token took the
registry from ~70 MB to ~730 MB of RSS. The refusal now reads no request, and the registry's
message limit is gRPC's default 4 MiB (`pdplane.core.grpc.util.SERVER_OPTIONS`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdplane.core.grpc import util as grpc_util
from pdplane.launch.ports import free_port_run
from pdplane.v1 import registry_pb2, registry_pb2_grpc
from tests.integration.registry.conftest import wait_until
from tests.integration.registry.fixtures import make_spec

TOKEN = "s3cret-registry-token"
REGISTER = "/pdplane.v1.Registry/Register"
_MB = 1 << 20
#: The bound asserted: growth of the registry's peak RSS over 8 refused 60 MiB calls (bytes).
MAX_PEAK_GROWTH = 100 * _MB


def _peak_rss(pid: int) -> int:
    """The process's peak resident set size (bytes), Linux's VmHWM."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _register_bytes(payload_len: int) -> bytes:
    """A RegisterRequest on the wire: field 1 (spec) whose length prefix announces
    `payload_len` bytes, followed by those bytes (never valid, never decoded when refused)."""
    length = bytearray()
    n = payload_len
    while True:
        byte, n = n & 0x7F, n >> 7
        length.append(byte | (0x80 if n else 0))
        if not n:
            break
    return b"\x0a" + bytes(length) + b"A" * payload_len


@pytest.fixture
def registry_process(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """`pdplane registry` with a token file; yields (address, pid)."""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs Linux /proc for the peak RSS")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    port = free_port_run()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdplane.cli.main",
            "registry",
            "--port",
            str(port),
            "--token-file",
            str(token_file),
        ],
        stderr=subprocess.DEVNULL,
        env=dict(os.environ),
    )
    address = f"127.0.0.1:{port}"
    try:
        assert wait_until(lambda: _serving(address), 20, interval=0.1)
        yield address, proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


def _serving(address: str) -> bool:
    with grpc_util.channel(address) as chan:
        try:
            reply = health_pb2_grpc.HealthStub(chan).Check(
                health_pb2.HealthCheckRequest(), timeout=1
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _raw_channel(address: str) -> grpc.Channel:
    # No client-side send limit: the server's own limit is what is under test.
    return grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)])


def _raw_register(
    chan: grpc.Channel, body: bytes, metadata: tuple[tuple[str, str], ...]
) -> grpc.StatusCode:
    call = chan.unary_unary(REGISTER, request_serializer=None, response_deserializer=None)
    try:
        call(body, metadata=metadata, timeout=30)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _register_with_token(address: str) -> registry_pb2.RegisterResponse:
    with grpc_util.channel(address) as chan:
        return registry_pb2_grpc.RegistryStub(chan).Register(  # type: ignore[no-any-return]
            registry_pb2.RegisterRequest(spec=make_spec("p0")),
            metadata=grpc_util.token_metadata(TOKEN),
            timeout=5,
        )


def test_unauthenticated_large_requests_are_refused_unread(
    registry_process: tuple[str, int],
) -> None:
    address, pid = registry_process
    body = _register_bytes(60 * _MB)
    before = _peak_rss(pid)
    with _raw_channel(address) as chan, futures.ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda _: _raw_register(chan, body, ()), range(8)))
    growth = _peak_rss(pid) - before
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 8
    print(f"registry peak RSS {before / _MB:.0f} MB -> {(before + growth) / _MB:.0f} MB")
    assert growth < MAX_PEAK_GROWTH, f"peak RSS grew {growth / _MB:.0f} MB"
    assert _register_with_token(address).lease_id


def test_authenticated_request_over_the_limit_is_resource_exhausted(
    registry_process: tuple[str, int],
) -> None:
    address, _pid = registry_process
    with _raw_channel(address) as chan:
        code = _raw_register(chan, _register_bytes(5 * _MB), grpc_util.token_metadata(TOKEN))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _serving(address)
    assert _register_with_token(address).lease_id
