"""Fixtures of the registry's integration tests: a running registry, a stub, a watch recorder."""

from __future__ import annotations

import datetime
import ipaddress
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from pdplane.core.grpc import util as grpc_util
from pdplane.launch.etcd import EtcdCluster, etcd_binary
from pdplane.registry.server import RegistryServer
from pdplane.v1 import registry_pb2, registry_pb2_grpc
from tests.integration.registry import fixtures
from tests.integration.registry.fixtures import running_registry_server


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.01) -> bool:
    """Polls `predicate` until truthy or `timeout` seconds passed; returns its last truth."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


class WatchRecorder:
    """Reads one WatchInstances stream on a thread and records every message (an event, or with
    `max_batch` > 1 a BATCH of them) with its arrival time (monotonic s)."""

    def __init__(
        self, address: str, from_revision: int = 0, token: str | None = None, max_batch: int = 0
    ) -> None:
        self._channel = grpc_util.channel(address)
        stub = registry_pb2_grpc.RegistryStub(self._channel)
        self._call = stub.WatchInstances(
            registry_pb2.WatchInstancesRequest(from_revision=from_revision, max_batch=max_batch),
            metadata=grpc_util.token_metadata(token),
        )
        self.events: list[tuple[float, registry_pb2.WatchEvent]] = []
        self.error: grpc.RpcError | None = None
        #: set once the stream's first message (its snapshot) or its error arrived
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for event in self._call:
                self.events.append((time.monotonic(), event))
                self.started.set()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.started.set()

    def of_type(self, kind: int) -> list[registry_pb2.WatchEvent]:
        return [e for _, e in list(self.events) if e.type == kind]

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(timeout=5)
        self._channel.close()


def _pdplane_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("pdplane-")}


@pytest.fixture(autouse=True)
def no_leftover_threads() -> Iterator[None]:
    """Every registry, client and watcher a test starts must have joined its threads by the
    end of the test (fixtures' teardown included). Threads that were already running (e.g. a
    session-wide gateway of the end-to-end tests) are not the test's."""
    before = _pdplane_threads()
    yield
    assert wait_until(lambda: _pdplane_threads() <= before, 5), [
        t.name for t in _pdplane_threads() - before
    ]


@pytest.fixture(scope="session")
def etcd_cluster() -> Iterator[EtcdCluster]:
    """A 3-member etcd cluster on loopback for the whole session (data on tmpfs when there is
    one: etcd fsyncs every write). Skipped where etcd is not installed, except in CI."""
    if etcd_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("etcd is not installed (apt-get install etcd-server)")
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    shm = Path("/dev/shm")
    data = Path(tempfile.mkdtemp(prefix="pdplane-etcd-", dir=shm if shm.is_dir() else None))
    cluster = EtcdCluster(data)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        import shutil

        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture(params=["memory", "etcd"], autouse=True)
def registry_store(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs every registry test on both stores: on etcd, each test's registries share a key
    prefix of their own in the session's cluster (so a restarted registry finds its data)."""
    if request.param == "etcd":
        cluster: EtcdCluster = request.getfixturevalue("etcd_cluster")
        fixtures.store_defaults.update(
            store="etcd", etcd_endpoints=cluster.endpoints, etcd_prefix=f"/t-{uuid.uuid4().hex}/"
        )
    try:
        yield request.param
    finally:
        fixtures.store_defaults.clear()


@pytest.fixture
def registry() -> Iterator[RegistryServer]:
    """A registry with a 1 s lease TTL and 200 ms heartbeats (short, to keep tests fast)."""
    with running_registry_server(lease_ttl_ms=1000, heartbeat_interval_ms=200) as server:
        yield server


@pytest.fixture
def stub(registry: RegistryServer) -> Iterator[registry_pb2_grpc.RegistryStub]:
    with grpc_util.channel(registry.address) as chan:
        yield registry_pb2_grpc.RegistryStub(chan)


@pytest.fixture
def recorder_factory() -> Iterator[Callable[..., WatchRecorder]]:
    made: list[WatchRecorder] = []

    def make(
        address: str, from_revision: int = 0, token: str | None = None, max_batch: int = 0
    ) -> WatchRecorder:
        made.append(WatchRecorder(address, from_revision, token, max_batch))
        # What happens after this returns is an event, not part of the snapshot: a test that
        # registers an instance right away and waits for its ADDED saw it in the snapshot
        # instead when the stream opened late (once, on a loaded CI machine).
        if not from_revision:  # a resumed watch may have nothing to send yet
            made[-1].started.wait(10)
        return made[-1]

    yield make
    for rec in made:
        rec.close()


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(certificate, key) PEM files of a self-signed certificate for 127.0.0.1/localhost."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    folder = tmp_path_factory.mktemp("tls")
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path
