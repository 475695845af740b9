"""Replicas sharing in-flight assignments over `InflightExchange` (real gRPC on loopback): a
peer's decision counts here as load, its releases end it, a new load report ends it as for own
decisions, a snapshot counts in flight but not as load, a dead peer's assignments are dropped,
and a replica among its own peers is skipped."""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from pdplane.core.grpc import util as grpc_util
from pdplane.scheduler.decision import Decider
from pdplane.scheduler.inflight import InflightTracker
from pdplane.scheduler.inflight_exchange import InflightExchange, serve_exchange
from pdplane.scheduler.port import Outcome, RequestFeatures
from pdplane.scheduler.view import CandidateView, StaticSource
from pdplane.v1 import inflight_pb2_grpc
from tests.unit.scheduler.conftest import instance

FLEET = (instance("p0", "prefill"), instance("d0", "decode"), instance("d1", "decode"))


@dataclass
class Replica:
    source: StaticSource
    service: Decider
    exchange: InflightExchange
    address: str
    server: grpc.aio.Server

    def decide(self, request_id: str) -> str:
        decision = self.service.schedule(RequestFeatures(request_id, "tiny", prompt_tokens=16))
        return decision.decode.instance_id

    def pending(self, instance_id: str) -> int:
        candidate = self.service.view.candidate(instance_id)
        assert candidate is not None
        return self.service.inflight.pending_requests(candidate)


@asynccontextmanager
async def replica(
    name: str, *, peers: Callable[[], list[str]] = list, token: str | None = None
) -> AsyncIterator[Replica]:
    source = StaticSource(*FLEET)
    view = CandidateView(source)
    tracker = InflightTracker()
    service = Decider(view, inflight=tracker)
    interceptors = [grpc_util.AioTokenAuthInterceptor(token)] if token else []
    server = grpc.aio.server(interceptors=interceptors)
    port = server.add_insecure_port("127.0.0.1:0")
    exchange = InflightExchange(
        tracker, view, replica_id=name, peers=peers(), token=token, resolve_every_s=0.05
    )
    inflight_pb2_grpc.add_InflightExchangeServicer_to_server(exchange.servicer, server)
    await server.start()
    await exchange.start()
    try:
        yield Replica(source, service, exchange, f"127.0.0.1:{port}", server)
    finally:
        await exchange.stop()
        await server.stop(0)


async def until(condition: Callable[[], object], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


@asynccontextmanager
async def pair(token: str | None = None) -> AsyncIterator[tuple[Replica, Replica]]:
    addresses: list[str] = []
    async with replica("b", token=token) as b:
        addresses.append(b.address)
        async with replica("a", peers=lambda: [*addresses], token=token) as a:
            b.exchange.peers = (a.address,)
            b_follow = asyncio.create_task(b.exchange._resolve_forever())
            try:
                await until(lambda: a.exchange.connected and b.exchange.connected)
                yield a, b
            finally:
                b_follow.cancel()


async def test_a_peers_assignment_counts_as_load_until_released() -> None:
    async with pair() as (a, b):
        assert a.decide("r1") == "d0"  # both idle: lowest id
        await until(lambda: b.pending("d0") == 1)
        # b knows d0 got a request since its report: least_loaded goes to d1, no herding.
        assert b.decide("r2") == "d1"
        await until(lambda: a.pending("d1") == 1)
        assert a.service.inflight.inflight_by_instance() == {"p0": 2, "d0": 1, "d1": 1}
        assert a.service.release("r1", Outcome.SUCCESS)
        await until(lambda: b.pending("d0") == 0)
        assert b.service.inflight.inflight_by_instance() == {"p0": 1, "d1": 1}


async def test_a_new_load_report_ends_peer_assignments_as_it_ends_own_ones() -> None:
    async with pair() as (a, b):
        a.decide("r1")
        await until(lambda: b.pending("d0") == 1)
        b.source.put(instance("d0", "decode", revision=2, num_running=1))  # d0 reports r1
        assert b.pending("d0") == 0
        assert b.service.inflight.inflight_by_instance()["d0"] == 1  # still in flight


async def test_a_snapshot_counts_in_flight_but_not_as_load() -> None:
    async with replica("a") as a:
        a.decide("r1")
        async with replica("b", peers=lambda: [a.address]) as b:
            await until(lambda: b.service.inflight.inflight_by_instance().get("d0") == 1)
            assert b.pending("d0") == 0
            a.decide("r2")  # live from now on
            await until(lambda: b.pending("d1") == 1)


async def test_a_dead_peers_assignments_are_dropped() -> None:
    async with replica("b") as b:
        async with replica("a") as a:
            b.exchange.peers = (a.address,)
            follow = asyncio.create_task(b.exchange._resolve_forever())
            await until(lambda: b.exchange.connected)
            a.decide("r1")
            await until(lambda: b.pending("d0") == 1)
        # a is gone (its server stopped): b forgets what it had from a.
        await until(lambda: len(b.service.inflight) == 0)
        assert b.exchange.connected == {}
        follow.cancel()


async def test_a_replica_listed_among_its_peers_is_skipped() -> None:
    addresses: list[str] = []
    async with replica("solo", peers=lambda: addresses) as solo:
        solo.exchange.peers = (solo.address,)
        follow = asyncio.create_task(solo.exchange._resolve_forever())
        await until(lambda: solo.address in solo.exchange._skip)
        solo.decide("r1")
        assert solo.pending("d0") == 1  # counted once, not again as a "peer"
        assert solo.exchange.connected == {}
        follow.cancel()


async def test_peers_need_the_token() -> None:
    async with replica("b", token="t") as b:
        wrong = InflightExchange(
            InflightTracker(), CandidateView(StaticSource(*FLEET)), peers=[b.address]
        )
        await wrong.start()
        await asyncio.sleep(0.3)
        assert wrong.connected == {}
        await wrong.stop()
    async with pair(token="t") as (a, b):
        a.decide("r1")
        await until(lambda: b.pending("d0") == 1)


@pytest.mark.parametrize("n", [200])
async def test_a_burst_on_one_replica_reaches_the_other_in_order(n: int) -> None:
    async with pair() as (a, b):
        for i in range(n):
            a.decide(f"r{i}")
        for i in range(0, n, 2):
            a.service.release(f"r{i}", Outcome.SUCCESS)
        await until(lambda: len(b.service.inflight) == n // 2)
        assert sum(b.pending(d) for d in ("d0", "d1")) == n // 2


async def test_own_recent_assignments_stand_for_the_peers_unseen_ones() -> None:
    async with pair() as (a, b):
        # b stops sending anything (no ticks, no updates): a keeps estimating its decisions.
        ticker = b.exchange._ticker
        assert ticker is not None
        ticker.cancel()
        a.decide("r1")
        d0 = a.service.view.candidate("d0")
        assert d0 is not None
        # a assumes its one peer decided the same: d0 counts r1 twice, while b is silent...
        await asyncio.sleep(0.1)
        assert a.service.load(d0) == d0.reported_load + 2
        # ...and once as soon as b talks again (two updates: b decides, then its ticks).
        b.exchange._ticker = asyncio.create_task(b.exchange._tick_forever())
        await until(lambda: a.service.load(d0) == d0.reported_load + 1, timeout=2.0)
        # b saw the real r1 (pending 1) and estimates nothing for a's decisions.
        assert b.exchange.unseen("d0") == 0.0


def _dns_only_certificate(folder: Path) -> tuple[str, str]:
    """A self-signed certificate naming only "localhost" (no IP address): (cert, key) paths."""
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
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_path), str(key_path)


async def test_over_tls_a_peer_is_verified_by_the_name_it_was_listed_under(
    tmp_path: Path,
) -> None:
    # The certificate names "localhost" only; the follower dials the address it resolved to
    # (127.0.0.1), so it must check the certificate against the name, as for a headless Service.
    cert, key = _dns_only_certificate(tmp_path)
    tracker = InflightTracker()
    view = CandidateView(StaticSource(*FLEET))
    service = Decider(view, inflight=tracker)
    publisher = InflightExchange(tracker, view, replica_id="tls-a")
    server, port = await serve_exchange(publisher, "127.0.0.1", 0, tls_cert=cert, tls_key=key)
    await publisher.start()
    follower_tracker = InflightTracker()
    follower = InflightExchange(
        follower_tracker,
        CandidateView(StaticSource(*FLEET)),
        replica_id="tls-b",
        peers=[f"localhost:{port}"],
        tls_ca=cert,
    )
    await follower.start()
    try:
        await until(lambda: "tls-a" in follower.connected.values())
        service.schedule(RequestFeatures("r1", "tiny", prompt_tokens=16))
        await until(lambda: follower_tracker.inflight_by_instance().get("d0") == 1)
    finally:
        await follower.stop()
        await publisher.stop()
        await server.stop(0)
