"""Every pdplane gRPC server answers bad messages with INVALID_ARGUMENT and a bounded detail.

Garbage bytes (not the RPC's protobuf message) on each RPC of the registry (directly and
through a host's heartbeat relay), the scheduler, the connector's KvTransfer + KvEvents server
and the sim; a 10,000-character label key at Register and a 1 MB model name at Schedule, whose
details must fit gRPC's trailers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc
import pytest

from pdplane.core.kv_events.log import KvEventLog
from pdplane.core.kv_events.servicer import add_kv_events_servicer
from pdplane.v1 import registry_pb2, registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.integration.registry.fixtures import make_spec, running_registry, running_relay
from tests.integration.scheduler.fixtures import running_scheduler

GARBAGE = b"\xff\xff\xff\xff\x0f"

REGISTRY = ["Register", "Heartbeat", "Deregister", "ListInstances", "GetInstance"]
REGISTRY_STREAMS = ["WatchInstances"]
REGISTRY_BIDI = ["HeartbeatStream", "HeartbeatBatchStream"]
KV_TRANSFER = ["CompleteTransfer", "AbortTransfer"]
NCCL = ["Preconnect"]


def _assert_invalid(error: grpc.RpcError, method: str) -> None:
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, error.details())
    assert "undecodable request" in (error.details() or ""), method


def _garbage_everywhere(
    address: str,
    unary: list[str] = (),  # type: ignore[assignment]
    server_streams: list[str] = (),  # type: ignore[assignment]
    client_streams: list[str] = (),  # type: ignore[assignment]
) -> None:
    """Sends GARBAGE to every named method ("/pkg.Service/Method")."""
    with grpc.insecure_channel(address) as channel:
        for method in unary:
            with pytest.raises(grpc.RpcError) as err:
                channel.unary_unary(method)(GARBAGE, timeout=5)
            _assert_invalid(err.value, method)
        for method in server_streams:
            with pytest.raises(grpc.RpcError) as err:
                list(channel.unary_stream(method)(GARBAGE, timeout=5))
            _assert_invalid(err.value, method)
        for method in client_streams:
            with pytest.raises(grpc.RpcError) as err:
                answer = channel.stream_stream(method)(iter([GARBAGE]), timeout=5)
                list(answer)
            _assert_invalid(err.value, method)


@pytest.fixture
def registry() -> Iterator[str]:
    with running_registry() as address:
        yield address


@pytest.mark.parametrize("through_relay", [False, True], ids=["direct", "relay"])
def test_registry_answers_garbage_with_invalid_argument(registry: str, through_relay: bool) -> None:
    # Through a host's heartbeat relay, HeartbeatStream is the relay's own; the rest reach the
    # registry as the bytes they were.
    with contextlib.ExitStack() as stack:
        address = registry
        if through_relay:
            address = f"127.0.0.1:{stack.enter_context(running_relay(registry)).port}"
        svc = "/pdplane.v1.Registry/"
        _garbage_everywhere(
            address,
            unary=[svc + m for m in REGISTRY],
            server_streams=[svc + m for m in REGISTRY_STREAMS],
            client_streams=[svc + m for m in REGISTRY_BIDI],
        )
        # ... and still serves.
        with grpc.insecure_channel(address) as channel:
            registry_pb2_grpc.RegistryStub(channel).ListInstances(
                registry_pb2.ListInstancesRequest(), timeout=5
            )


def test_registry_bounds_an_echoed_10k_label_key(registry: str) -> None:
    spec = make_spec("p0")
    spec.labels["k" * 10_000 + "!"] = "v"
    with grpc.insecure_channel(registry) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Register(registry_pb2.RegisterRequest(spec=spec), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    details = err.value.details() or ""
    assert "bad label key" in details and "10001 characters" in details
    assert len(details) < 300


def test_scheduler_answers_garbage_and_huge_models_with_invalid_argument(registry: str) -> None:
    with running_scheduler(registry) as address:
        svc = "/pdplane.v1.Scheduler/"
        _garbage_everywhere(address, unary=[svc + m for m in ("Schedule", "Release")])
        with grpc.insecure_channel(address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            request = scheduler_pb2.ScheduleRequest(
                request_id="r1", model="m" * 1_000_000, prompt_tokens=1
            )
            with pytest.raises(grpc.RpcError) as err:
                stub.Schedule(request, timeout=5)
    # No instance serves it: UNAVAILABLE naming the (cut) model, not RESOURCE_EXHAUSTED.
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert "1000000 characters" in (err.value.details() or "")
    assert len(err.value.details() or "") < 1000


def test_connector_kv_server_answers_garbage_with_invalid_argument() -> None:
    import torch

    from pdplane.connector.holds import HoldTable
    from pdplane.connector.kv_cache import KvCacheView
    from pdplane.connector.server import HoldAccess, start_kv_server, worker_services
    from pdplane.connector.transports.base import ServiceBinding
    from pdplane.connector.transports.nccl.blocks import BlockMover, layer_byte_view
    from pdplane.connector.transports.nccl.engine import NcclEngine
    from pdplane.connector.transports.nccl.servicer import NcclKvTransferServicer
    from pdplane.connector.transports.tcp import TcpTransport
    from pdplane.v1 import instance_pb2, kv_transfer_nccl_pb2_grpc
    from tests.unit.connector.nccl.fabric import Fabric, FakeComms

    layout = instance_pb2.KvLayout(
        num_layers=1, num_kv_heads=1, head_size=8, block_size=4, dtype="float32"
    )
    transport = TcpTransport()
    transport.bind(KvCacheView({"l0": torch.zeros(4, 8)}))
    access = HoldAccess(HoldTable(), layout, arrival_wait_s=0.1)
    hub = KvEventLog()
    # The NCCL service over CPU stand-ins of NCCL: garbage is refused before any NCCL call.
    views = [layer_byte_view(torch.zeros(2, 4, 8), 1)]
    engine = NcclEngine(0, views, comms=FakeComms(Fabric()), mover=BlockMover(views, "cpu"))
    engine.access = access
    nccl = NcclKvTransferServicer(engine, None)
    extra = [
        ServiceBinding("pdplane.v1.KvEvents", lambda s: add_kv_events_servicer(s, hub), 1),
        ServiceBinding(
            "pdplane.v1.NcclKvTransfer",
            lambda s: kv_transfer_nccl_pb2_grpc.add_NcclKvTransferServicer_to_server(nccl, s),
        ),
    ]
    server = start_kv_server([*worker_services(transport, access), *extra], "127.0.0.1:0")
    try:
        _garbage_everywhere(
            f"127.0.0.1:{server.port}",
            unary=[f"/pdplane.v1.KvTransfer/{m}" for m in KV_TRANSFER]
            + [f"/pdplane.v1.NcclKvTransfer/{m}" for m in NCCL],
            server_streams=[
                "/pdplane.v1.TcpKvTransfer/PullBlocks",
                "/pdplane.v1.KvEvents/Subscribe",
            ],
            client_streams=[
                "/pdplane.v1.TcpKvTransfer/PushBlocks",
                "/pdplane.v1.NcclKvTransfer/Pair",
            ],
        )
    finally:
        server.stop(0)


def test_sim_answers_garbage_with_invalid_argument() -> None:
    from pdplane.sim.testing import running_sims

    with running_sims(["prefill"]) as sims:
        _garbage_everywhere(
            sims[0].kv_endpoint,
            unary=[f"/pdplane.v1.KvTransfer/{m}" for m in KV_TRANSFER],
            server_streams=[
                "/pdplane.v1.TcpKvTransfer/PullBlocks",
                "/pdplane.v1.KvEvents/Subscribe",
            ],
        )
