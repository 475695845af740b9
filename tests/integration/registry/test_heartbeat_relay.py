"""A host's heartbeat relay (`pdplane registry-relay`) and the registry's HeartbeatBatchStream:
instances behind a relay keep their leases and report their load while the registry reads one
message per tick for all of them; refusals and a lost registry reach the instances."""

from __future__ import annotations

import contextlib
import functools
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdplane.core.grpc import util as grpc_util
from pdplane.launch.ports import free_port_run
from pdplane.registry.client import RegistrationClient
from pdplane.registry.servicer import MAX_HEARTBEAT_BATCH
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from tests.integration.registry.conftest import WatchRecorder, wait_until
from tests.integration.registry.fixtures import (
    make_spec,
    running_registry,
    running_registry_server,
    running_relay,
)

Ev = registry_pb2.WatchEvent
TOKEN, ADMIN = "relay-test-token", "relay-test-admin"
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]


def _beat(instance_id: str, lease_id: str, running: int = 0) -> registry_pb2.HeartbeatRequest:
    return registry_pb2.HeartbeatRequest(
        instance_id=instance_id,
        lease_id=lease_id,
        load=instance_pb2.LoadReport(num_running=running),
    )


def _climbing_load(counter: Iterator[int]) -> instance_pb2.LoadReport:
    return instance_pb2.LoadReport(num_running=next(counter))


class _Stream:
    """One bidirectional stream driven message by message from the test's thread."""

    def __init__(self, method: Callable[..., Iterator[object]], **kwargs: object) -> None:
        self._requests: queue.Queue[object] = queue.Queue()
        self._replies = method(iter(self._requests.get, None), **kwargs)

    def send(self, message: object) -> object:
        self._requests.put(message)
        return next(self._replies)

    def close(self) -> None:
        self._requests.put(None)


def test_a_batch_is_answered_in_order_and_a_refused_heartbeat_does_not_end_the_stream() -> None:
    with running_registry(lease_ttl_ms=5000) as address, grpc_util.channel(address) as chan:
        stub = registry_pb2_grpc.RegistryStub(chan)
        leases = {
            name: stub.Register(registry_pb2.RegisterRequest(spec=make_spec(name))).lease_id
            for name in ("p0", "p1")
        }
        stream = _Stream(stub.HeartbeatBatchStream, timeout=10)
        first = stream.send(
            registry_pb2.HeartbeatBatch(
                heartbeats=[
                    _beat("p0", leases["p0"], 3),
                    _beat("p1", "no-such-lease"),
                    _beat("p1", leases["p1"], 5),
                ]
            )
        )
        assert isinstance(first, registry_pb2.HeartbeatBatchResponse)
        assert [o.code for o in first.outcomes] == [0, NOT_FOUND, 0]
        assert first.outcomes[0].response.state == instance_pb2.INSTANCE_STATE_SERVING
        assert first.outcomes[0].response.lease_ttl_ms == 5000
        assert "p1" in first.outcomes[1].details
        running = {
            name: stub.GetInstance(
                registry_pb2.GetInstanceRequest(instance_id=name)
            ).load.num_running
            for name in ("p0", "p1")
        }
        assert running == {"p0": 3, "p1": 5}
        # The stream goes on after a refusal: the next batch is answered as well.
        second = stream.send(registry_pb2.HeartbeatBatch(heartbeats=[_beat("p0", leases["p0"], 7)]))
        assert isinstance(second, registry_pb2.HeartbeatBatchResponse)
        assert [o.code for o in second.outcomes] == [0]
        stream.close()


def test_a_batch_over_the_limit_ends_the_stream_with_invalid_argument() -> None:
    with running_registry() as address, grpc_util.channel(address) as chan:
        stub = registry_pb2_grpc.RegistryStub(chan)
        stream = _Stream(stub.HeartbeatBatchStream, timeout=10)
        with pytest.raises(grpc.RpcError) as refused:
            stream.send(
                registry_pb2.HeartbeatBatch(
                    heartbeats=[_beat("p0", "x")] * (MAX_HEARTBEAT_BATCH + 1)
                )
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert str(MAX_HEARTBEAT_BATCH) in (refused.value.details() or "")


def test_instances_behind_a_relay_keep_their_leases_and_report_load_in_few_messages(
    recorder_factory: Callable[..., WatchRecorder],
) -> None:
    # Leases of 1 s renewed by 200 ms heartbeats that reach the registry as one batch per
    # 200 ms tick: over 3 TTLs no instance may lapse, and each one's load must arrive.
    with (
        running_registry(lease_ttl_ms=1000, heartbeat_interval_ms=200) as address,
        running_relay(address, flush_interval_ms=200, stale_after_ms=1000) as relay,
        grpc_util.channel(address) as chan,
    ):
        stub = registry_pb2_grpc.RegistryStub(chan)
        watch = recorder_factory(address)
        counters = {f"i{n}": itertools.count(1) for n in range(6)}
        clients = [
            RegistrationClient(
                f"127.0.0.1:{relay.port}",
                make_spec(name),
                functools.partial(_climbing_load, counter),
            )
            for name, counter in counters.items()
        ]
        for client in clients:
            client.start()
        try:
            assert all(client.wait_registered(5) for client in clients)
            beats_at_start = relay.relay.heartbeats_sent
            # Every instance's load climbs past 10 at the registry (>= 10 heartbeats each).
            assert wait_until(
                lambda: all(
                    stub.GetInstance(
                        registry_pb2.GetInstanceRequest(instance_id=name)
                    ).load.num_running
                    > 10
                    for name in counters
                ),
                10,
            )
            assert not watch.of_type(Ev.REMOVED), "a lease lapsed behind the relay"
            heartbeats = relay.relay.heartbeats_sent - beats_at_start
            assert heartbeats >= 6 * 8
            # Six instances on one host: a batch carries about six heartbeats, not one.
            assert relay.relay.batches_sent * 3 <= relay.relay.heartbeats_sent
        finally:
            for client in clients:
                client.stop()


def test_a_refusal_reaches_the_instance_behind_the_relay_and_it_registers_again(
    recorder_factory: Callable[..., WatchRecorder],
) -> None:
    with (
        running_registry_server(
            lease_ttl_ms=2000, heartbeat_interval_ms=200, token=TOKEN, admin_token=ADMIN
        ) as registry,
        running_relay(
            registry.address, token=TOKEN, flush_interval_ms=200, stale_after_ms=1000
        ) as relay,
        grpc_util.channel(registry.address) as chan,
    ):
        stub = registry_pb2_grpc.RegistryStub(chan)
        watch = recorder_factory(registry.address, token=TOKEN)
        client = RegistrationClient(f"127.0.0.1:{relay.port}", make_spec("p0"), token=TOKEN)
        client.start()
        try:
            assert client.wait_registered(5)
            assert wait_until(lambda: len(watch.of_type(Ev.ADDED)) == 1, 5)
            # An operator removes it at the registry: its lease is gone, so the next batch's
            # heartbeat is NOT_FOUND, the relay ends the instance's stream with it, and the
            # instance registers again (through the relay).
            stub.Deregister(
                registry_pb2.DeregisterRequest(instance_id="p0"),
                metadata=grpc_util.token_metadata(ADMIN),
            )
            assert wait_until(lambda: len(watch.of_type(Ev.ADDED)) == 2, 5)
            assert len(watch.of_type(Ev.REMOVED)) == 1
        finally:
            client.stop()


def test_the_relay_checks_the_token_and_forwards_calls_with_the_callers_own() -> None:
    # The relay holds the shared token only; an operator's admin call passes through it and
    # the registry, which holds both, authenticates it.
    with (
        running_registry(token=TOKEN, admin_token=ADMIN) as address,
        running_relay(address, token=TOKEN) as relay,
        grpc_util.channel(f"127.0.0.1:{relay.port}") as chan,
    ):
        stub = registry_pb2_grpc.RegistryStub(chan)
        request = registry_pb2.RegisterRequest(spec=make_spec("p0"))
        with pytest.raises(grpc.RpcError) as refused:
            stub.Register(request, timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = stub.Register(request, timeout=5, metadata=grpc_util.token_metadata(TOKEN))
        assert reply.lease_id
        # The relay's own HeartbeatStream refuses a caller without the token.
        stream = _Stream(stub.HeartbeatStream, timeout=5)
        with pytest.raises(grpc.RpcError) as anonymous:
            stream.send(_beat("p0", reply.lease_id))
        assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The registry's own refusals come back as it sent them.
        with pytest.raises(grpc.RpcError) as taken:
            stub.Register(request, timeout=5, metadata=grpc_util.token_metadata(TOKEN))
        assert taken.value.code() == grpc.StatusCode.ALREADY_EXISTS
        listed = stub.ListInstances(
            registry_pb2.ListInstancesRequest(), metadata=grpc_util.token_metadata(TOKEN)
        )
        assert [i.spec.instance_id for i in listed.instances] == ["p0"]
        streamed = stub.ListInstancesStream(
            registry_pb2.ListInstancesRequest(), metadata=grpc_util.token_metadata(TOKEN)
        )
        assert [i.spec.instance_id for part in streamed for i in part.instances] == ["p0"]
        drained = stub.Deregister(
            registry_pb2.DeregisterRequest(instance_id="p0", drain=True),
            timeout=5,
            metadata=grpc_util.token_metadata(ADMIN),
        )
        assert drained.state == instance_pb2.INSTANCE_STATE_DRAINING


def test_heartbeats_through_a_relay_that_lost_its_registry_end_unavailable() -> None:
    with contextlib.ExitStack() as registry_running:
        server = registry_running.enter_context(
            running_registry_server(lease_ttl_ms=5000, heartbeat_interval_ms=200)
        )
        with (
            running_relay(server.address, flush_interval_ms=200, stale_after_ms=600) as relay,
            grpc_util.channel(f"127.0.0.1:{relay.port}") as chan,
        ):
            stub = registry_pb2_grpc.RegistryStub(chan)
            lease = stub.Register(registry_pb2.RegisterRequest(spec=make_spec("p0"))).lease_id
            stream = _Stream(stub.HeartbeatStream, timeout=20)
            answer = stream.send(_beat("p0", lease))
            assert isinstance(answer, registry_pb2.HeartbeatResponse)
            assert answer.lease_ttl_ms == 5000
            registry_running.close()  # the registry stops
            # Answered from the relay's last answer until the registry has been silent for
            # stale_after (0.6 s), then UNAVAILABLE: the instance's client retries elsewhere.
            paced = threading.Event()
            with pytest.raises(grpc.RpcError) as lost:
                while not paced.wait(0.05):
                    stream.send(_beat("p0", lease))
            assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "registry" in (lost.value.details() or "")


def test_after_a_registry_outage_longer_than_stale_after_the_relay_recovers(
    recorder_factory: Callable[..., WatchRecorder],
) -> None:
    # The registry is away for 3x stale_after: the relay stops vouching (health NOT_SERVING),
    # then the registry is back on its port with no leases (memory store): the relay links
    # again, the instance is told NOT_FOUND, registers again and is listed; health SERVING.
    port = free_port_run()
    settings = {"lease_ttl_ms": 1000, "heartbeat_interval_ms": 200}
    with contextlib.ExitStack() as first_registry:
        first_registry.enter_context(running_registry_server(port, **settings))
        with (
            running_relay(f"127.0.0.1:{port}", flush_interval_ms=200, stale_after_ms=600) as relay,
            grpc_util.channel(f"127.0.0.1:{relay.port}") as chan,
        ):
            health = health_pb2_grpc.HealthStub(chan)

            def status(service: str = "pdplane.v1.Registry") -> int:
                request = health_pb2.HealthCheckRequest(service=service)
                return health.Check(request, timeout=5).status

            client = RegistrationClient(f"127.0.0.1:{relay.port}", make_spec("p0"))
            client.start()
            try:
                assert client.wait_registered(5)
                assert status() == health_pb2.HealthCheckResponse.SERVING
                first_registry.close()
                assert wait_until(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, 5)
                # The process itself stays SERVING (for a liveness probe).
                assert status("") == health_pb2.HealthCheckResponse.SERVING
                time.sleep(1.8)  # the outage: three times stale_after
                with (
                    running_registry_server(port, **settings) as registry,
                    grpc_util.channel(registry.address) as direct,
                ):
                    stub = registry_pb2_grpc.RegistryStub(direct)

                    def heartbeat_ns() -> int:
                        listed = stub.ListInstances(registry_pb2.ListInstancesRequest())
                        beats = [i.last_heartbeat.ToNanoseconds() for i in listed.instances]
                        return max(beats, default=0)

                    # Listed again (registered anew on the memory store, taken over from
                    # etcd on the other), its heartbeats arriving through the relay.
                    assert wait_until(lambda: heartbeat_ns() > 0, 10), client.last_error
                    assert wait_until(lambda: status() == health_pb2.HealthCheckResponse.SERVING, 5)
                    watch = recorder_factory(registry.address)
                    before = heartbeat_ns()
                    time.sleep(2.0)  # it stays: heartbeats renew its lease
                    assert not watch.of_type(Ev.REMOVED), client.last_error
                    assert heartbeat_ns() > before
            finally:
                client.stop()


def test_a_relay_loop_is_refused_not_followed() -> None:
    a = free_port_run(2)
    b = a + 1
    with (
        running_relay(f"127.0.0.1:{b}", port=a) as relay_a,
        running_relay(f"127.0.0.1:{a}", port=b),
        grpc_util.channel(f"127.0.0.1:{relay_a.port}") as chan,
    ):
        stub = registry_pb2_grpc.RegistryStub(chan)
        errors: list[grpc.RpcError] = []

        def refused() -> bool:
            # The relays' channels to each other may still be in their reconnect backoff
            # (each started before the other listened): UNAVAILABLE until they connect.
            try:
                stub.ListInstances(registry_pb2.ListInstancesRequest(), timeout=5)
            except grpc.RpcError as exc:
                errors.append(exc)
                return exc.code() != grpc.StatusCode.UNAVAILABLE
            return True

        assert wait_until(refused, 10, interval=0.2)
        assert errors[-1].code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "leads back" in (errors[-1].details() or "")


def test_leases_shorter_than_the_flush_interval_shorten_the_relay_s_ticks(
    recorder_factory: Callable[..., WatchRecorder],
) -> None:
    # Leases of 600 ms behind ticks of 1 s would lapse between two batches; the relay learns
    # the TTL from the first answer and sends every 200 ms instead.
    with (
        running_registry(lease_ttl_ms=600, heartbeat_interval_ms=150) as address,
        running_relay(address, flush_interval_ms=1000, stale_after_ms=3000) as relay,
    ):
        watch = recorder_factory(address)
        client = RegistrationClient(f"127.0.0.1:{relay.port}", make_spec("p0"))
        client.start()
        try:
            assert client.wait_registered(5)
            assert wait_until(lambda: watch.of_type(Ev.ADDED), 5)
            time.sleep(3.0)  # five TTLs
            assert not watch.of_type(Ev.REMOVED)
        finally:
            client.stop()
