"""Workers of the NCCL control-plane tests on CPU (fixtures in conftest.py): a KV cache, a hold
table, a KV server with the NCCL service, and an NCCL engine on the CPU stand-ins for NCCL and
CUDA (tests/unit/connector/nccl/fabric.py); and what the tests do with them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pdplane.connector.holds import HoldTable
from pdplane.connector.peers import PeerPool
from pdplane.connector.server import KvServer
from pdplane.connector.transports.nccl.engine import NcclEngine
from pdplane.v1 import instance_pb2, kv_transfer_pb2

NUM_BLOCKS = 16
LAYOUT = instance_pb2.KvLayout(
    num_layers=2, num_kv_heads=2, head_size=8, block_size=4, dtype="bfloat16"
)


@dataclass
class Node:
    name: str
    engine: NcclEngine
    caches: list[torch.Tensor]
    holds: HoldTable
    server: KvServer
    peers: PeerPool

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def states(self) -> dict[str, str]:
        return self.engine.states()["active"]


def pull(
    decode: Node,
    prefill: Node,
    tid: str,
    src: list[int],
    dst: list[int],
    hold: bool = True,
    **kw: Any,
) -> Any:
    if hold:
        assert prefill.holds.add(f"req-{tid}", tid, src, 60)
    request = kv_transfer_pb2.PullBlocksRequest(
        transfer_id=tid,
        block_indices=list(range(len(dst))),
        expected_layout=LAYOUT,
        requester_id=decode.name,
    )
    return decode.engine.pull(
        prefill.name,
        decode.peers.get(prefill.endpoint),
        request,
        dst,
        time.monotonic() + 10,
        **kw,
    )


def same(decode: Node, dst: list[int], prefill: Node, src: list[int]) -> bool:
    return all(
        torch.equal(d[:, dst], s[:, src])
        for d, s in zip(decode.caches, prefill.caches, strict=True)
    )


def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
