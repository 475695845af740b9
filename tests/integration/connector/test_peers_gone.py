"""Peers that leave the registry, on CPU with the TCP transport: two workers (a prefill and a
decode, real gRPC servers) follow a real registry; when one is killed (its lease expires) or
drained (it goes once idle), the other drops its channel, the KV it pushed, the holds meant for
it, within the lease TTL, says so in its log and counts it (`peers_gone`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from pdplane.connector.config import ConnectorConfig
from pdplane.connector.worker_side import WorkerSide
from pdplane.core.grpc import util as grpc_util
from pdplane.launch.ports import free_port_run
from pdplane.registry.client import RegistrationClient
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from tests.integration.registry.fixtures import make_spec, running_registry

#: 3 s, heartbeats every 0.3 s: with a 1 s lease, a busy 2-core host once starved the test's
#: heartbeat thread for over a second and p0's lease lapsed before the kill.
TTL_MS = 3000
SHAPE = (8, 2, 4, 16)  # CPU layout: block index first
LAYOUT = instance_pb2.KvLayout(
    num_layers=2, num_kv_heads=2, head_size=8, block_size=4, dtype="float32"
)


def _until(cond: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until `cond()`; fails after `timeout`."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.02)
    return time.monotonic() - t0


def _worker(registry: str, name: str, role: str) -> WorkerSide:
    config = ConnectorConfig.model_validate(
        {
            "registry": registry,
            "url": "http://127.0.0.1:1",
            "kv_port": free_port_run(),
            "mode": "push",
            "push_buffer_bytes": 1 << 20,
            "preconnect_timeout_s": 5,
        }
    )
    side = WorkerSide(config, LAYOUT, name, num_blocks=SHAPE[0], role=role, model="tiny")
    side.register_kv_caches({f"l{i}": torch.randn(SHAPE) for i in range(2)})
    return side


def _spec(side: WorkerSide, role: instance_pb2.Role.ValueType) -> instance_pb2.InstanceSpec:
    return make_spec(
        side.instance_id, role, kv_endpoint=side.config.kv_endpoint(), kv_layout=LAYOUT
    )


class _Heartbeats:
    """Registers an instance and heartbeats it until `kill()`: then its lease expires."""

    def __init__(self, registry: str, spec: instance_pb2.InstanceSpec) -> None:
        self._channel = grpc_util.channel(registry)
        stub = registry_pb2_grpc.RegistryStub(self._channel)
        grant = stub.Register(
            registry_pb2.RegisterRequest(spec=spec, lease_ttl_ms=TTL_MS), timeout=5
        )
        assert grant.lease_ttl_ms == TTL_MS
        lease = grant.lease_id
        self._stop = threading.Event()

        def beat() -> None:
            while not self._stop.wait(0.2):
                stub.Heartbeat(
                    registry_pb2.HeartbeatRequest(instance_id=spec.instance_id, lease_id=lease),
                    timeout=2,
                )

        threading.Thread(target=beat, daemon=True).start()

    def kill(self) -> None:
        self._stop.set()
        self._channel.close()


@pytest.fixture
def pair() -> Iterator[tuple[str, WorkerSide, WorkerSide]]:
    # heartbeats every 0.3 s: the registry grants the TTL asked for (at least 2 beats)
    with running_registry(lease_ttl_ms=TTL_MS, heartbeat_interval_ms=300) as registry:
        prefill = _worker(registry, "p0", "kv_producer")
        decode = _worker(registry, "d0", "kv_consumer")
        try:
            yield registry, prefill, decode
        finally:
            prefill.shutdown()
            decode.shutdown()


def test_workers_are_ready_once_the_registry_view_is_in(
    pair: tuple[str, WorkerSide, WorkerSide],
) -> None:
    _, prefill, decode = pair
    for side in (prefill, decode):
        assert side.follower is not None
        assert side.follower.ready.wait(10), "the start-up pre-connect never ended"


def test_a_killed_prefill_is_dropped_within_the_lease_ttl(
    pair: tuple[str, WorkerSide, WorkerSide], caplog: pytest.LogCaptureFixture
) -> None:
    registry, prefill, decode = pair
    caplog.set_level(logging.WARNING, logger="pdplane.connector.worker_side")
    beats = _Heartbeats(registry, _spec(prefill, instance_pb2.ROLE_PREFILL))
    assert decode.follower is not None
    _until(lambda: "p0" in decode.follower.watch.known(), 5, "decode sees p0")
    # decode pre-connected (a channel to p0, connected) and p0 pushed KV into decode's buffer
    _until(lambda: len(decode.peers) == 1, 5, "decode's channel to p0")
    session = prefill.transport.push_session(
        prefill.peers.get(decode.config.kv_endpoint()),
        "p0",
        [("t1", [1, 2])],
        LAYOUT,
        time.monotonic() + 5,
    )
    for layer in range(2):
        session.send_layer(layer)
    session.finish()
    buffer = decode.transport.receive_buffer
    assert buffer is not None
    _until(lambda: buffer.headroom_bytes < buffer.capacity_bytes, 5, "the pushed KV")
    assert decode.peers_gone == 0, "p0 left before it was killed (its lease lapsed)"
    beats.kill()
    took = _until(lambda: decode.peers_gone == 1, TTL_MS / 1000 + 3, "p0 dropped")
    # The lease TTL, plus the registry's expiry check, the watch event and the follower's
    # reaction, all in this one process on a busy host: not the gRPC timeouts of a next pull.
    assert took < TTL_MS / 1000 + 1.5
    assert len(decode.peers) == 0  # channel closed
    assert buffer.headroom_bytes == buffer.capacity_bytes  # its push freed
    assert any("peer p0 left the registry" in r.message for r in caplog.records)
    stats = decode.stats()
    assert stats is not None and stats.data["counters"]["peers_gone"] == 1


def test_a_drained_decode_is_dropped_and_its_holds_end(
    pair: tuple[str, WorkerSide, WorkerSide],
) -> None:
    registry, prefill, decode = pair
    client = RegistrationClient(
        registry, _spec(decode, instance_pb2.ROLE_DECODE), lease_ttl_ms=TTL_MS
    )
    client.start()
    assert client.wait_registered(5)
    assert prefill.follower is not None
    _until(lambda: "d0" in prefill.follower.watch.known(), 5, "prefill sees d0")
    # a hold meant for d0 (the gateway named it), one for nobody in particular
    assert prefill.holds.add("r1", "t1", [1, 2], 60, peer_id="d0")
    assert prefill.holds.add("r2", "t2", [3], 60)
    t0 = time.monotonic()
    client.stop(drain=True, drain_timeout=5)  # DRAINING, then gone once idle
    _until(lambda: prefill.peers_gone == 1, TTL_MS / 1000 + 2, "d0 dropped")
    assert time.monotonic() - t0 < TTL_MS / 1000 + 1.5
    assert prefill.holds.pop_finished() == {"r1"}  # the other hold stays
    assert len(prefill.holds) == 1
