"""Fixtures of the NCCL control-plane tests on CPU: the fake NCCL fabric and `start_node`
(workers on loopback, see nodes.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from pdplane.connector.holds import HoldTable
from pdplane.connector.peers import PeerPool
from pdplane.connector.server import HoldAccess, start_kv_server
from pdplane.connector.transports.base import ServiceBinding
from pdplane.connector.transports.nccl.blocks import BlockMover, layer_byte_view
from pdplane.connector.transports.nccl.engine import NcclEngine
from pdplane.connector.transports.nccl.servicer import SERVICE_NAME, NcclKvTransferServicer
from pdplane.v1 import kv_transfer_nccl_pb2_grpc
from tests.integration.connector.nccl.nodes import LAYOUT, NUM_BLOCKS, Node
from tests.unit.connector.nccl.fabric import Fabric, FakeComms, cpu_cuda  # noqa: F401 - a fixture


@pytest.fixture
def fabric(cpu_cuda: list[int]) -> Fabric:  # noqa: F811 - the fixture imported above
    return Fabric()


@pytest.fixture
def start_node(fabric: Fabric) -> Iterator[Callable[..., Node]]:
    nodes: list[Node] = []

    def start(name: str, seed: int = 0, cap: int = 64, chunk_bytes: int = 1 << 20) -> Node:
        gen = torch.Generator().manual_seed(seed)
        shape = (2, NUM_BLOCKS, 4, 2, 8)  # FlashAttention layout, int16 stand-in for bf16
        caches = [
            torch.randint(-999, 999, shape, generator=gen, dtype=torch.int16) for _ in range(2)
        ]
        views = [layer_byte_view(t, 1) for t in caches]
        engine = NcclEngine(
            0,
            views,
            chunk_bytes,
            connect_timeout_s=5.0,
            max_pairs=cap,
            comms=FakeComms(fabric),
            mover=BlockMover(views, "cpu"),
        )
        engine.instance_id = name
        holds = HoldTable()
        engine.access = HoldAccess(holds, LAYOUT, arrival_wait_s=0.1)
        peers = PeerPool()
        servicer = NcclKvTransferServicer(engine, peers)
        binding = ServiceBinding(
            SERVICE_NAME,
            lambda s: kv_transfer_nccl_pb2_grpc.add_NcclKvTransferServicer_to_server(servicer, s),
            threads=cap + 8,
        )
        node = Node(name, engine, caches, holds, start_kv_server([binding], "127.0.0.1:0"), peers)
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        node.engine.close()
        node.server.stop(0)
        node.peers.close()
