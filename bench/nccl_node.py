"""A KV node for the NCCL tests and benchmark: one process owning a paged KV cache on a GPU.

The process builds a FlashAttention-layout KV cache (`[2, num_blocks, block_size, num_kv_heads,
head_size]` per layer, random contents), binds the `nccl` transport to it, serves
`pdplane.v1.KvTransfer` and `pdplane.v1.NcclKvTransfer` on 127.0.0.1 (port 0), prints
`{"port": N}` and then executes JSON commands read line by line from stdin, answering one JSON
line each on stdout:

  hold      {transfer_id, block_ids}                  -> prefill: hold blocks for a pull
  checksums {block_ids}                               -> per-block checksums (all layers)
  pull      {endpoint, transfer_id, block_indices, local_ids, timeout_s[, remote_ids]}
  push      {endpoint, items: [{transfer_id, block_ids}], timeout_s}
  take      {transfer_id, local_ids, timeout_s}       -> decode: copy a pushed transfer in
  raw       {peer, is_send, nbytes, iters, timeout_s} -> plain NCCL send/recv of one buffer
  comms     {}                                        -> communicators and their states
  exit      {}

Events (not answers) are lines with an "event" key, e.g. {"event": "send_started"}.
Run with distinct NCCL_HOSTID per process when two share one GPU.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import signal
import statistics
import sys
import threading
import time
import traceback
from typing import Any

import grpc
import torch

from pdplane.connector.holds import HoldTable
from pdplane.connector.kv_cache import KvCacheView
from pdplane.connector.peers import PeerPool
from pdplane.connector.server import HoldAccess, KvTransferServicer, start_kv_server
from pdplane.connector.transports.base import PullRequest, ServiceBinding, TransferError
from pdplane.connector.transports.nccl import NcclTransport
from pdplane.connector.transports.nccl.communicator import P2pOp
from pdplane.connector.transports.nccl.plan import Strategy
from pdplane.connector.transports.nccl.service import SERVICE_NAME, NcclKvTransferServicer
from pdplane.v1 import instance_pb2, kv_transfer_nccl_pb2_grpc

_out_lock = threading.Lock()


def emit(obj: dict[str, Any]) -> None:
    with _out_lock:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


class _ObservedContext:
    """A servicer context that reports the moment the transport accepts a SendBlocks
    (its initial metadata: the NCCL sends start right after) as a `send_started` event."""

    def __init__(self, context: grpc.ServicerContext, transfer_id: str) -> None:
        self._context = context
        self._transfer_id = transfer_id

    def send_initial_metadata(self, metadata: Any) -> None:
        self._context.send_initial_metadata(metadata)
        emit({"event": "send_started", "transfer_id": self._transfer_id})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class ObservedNcclServicer(NcclKvTransferServicer):
    """The transport's own service, reporting when a SendBlocks starts sending."""

    def SendBlocks(self, request: Any, context: grpc.ServicerContext) -> Any:
        return super().SendBlocks(request, _ObservedContext(context, request.blocks.transfer_id))


class Node:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = args.device
        torch.cuda.set_device(self.device)
        dtype = getattr(torch, args.dtype)
        gen = torch.Generator(device=f"cuda:{self.device}").manual_seed(args.seed)
        shape = (2, args.num_blocks, args.block_size, args.kv_heads, args.head_size)
        caches = {
            f"model.layers.{i}.self_attn.attn": torch.randn(
                shape, dtype=dtype, device=f"cuda:{self.device}", generator=gen
            )
            for i in range(args.layers)
        }
        self.layout = instance_pb2.KvLayout(
            num_layers=args.layers,
            num_kv_heads=args.kv_heads,
            head_size=args.head_size,
            block_size=args.block_size,
            dtype=args.dtype,
        )
        self.transport = NcclTransport(
            nccl_strategy=args.strategy,
            nccl_chunk_bytes=args.chunk_bytes,
            push_buffer_bytes=args.push_gpu_bytes,
            push_spill_bytes=args.push_host_bytes,
        )
        self.peers = PeerPool()
        self.transport.bind(KvCacheView(caches, args.num_blocks), self.peers)
        wgen = torch.Generator(device=f"cuda:{self.device}").manual_seed(1234)
        inner = int(self.transport.engine.mover.views[0].shape[2])
        self.weights = torch.randint(
            1, 1 << 20, (inner,), dtype=torch.int64, device=f"cuda:{self.device}", generator=wgen
        )
        self.holds = HoldTable()
        access = HoldAccess(self.holds, self.layout)
        nccl = ObservedNcclServicer(access, self.transport.engine, self.transport.receiver)
        services = [
            KvTransferServicer(access).binding(),
            ServiceBinding(
                SERVICE_NAME,
                lambda server: kv_transfer_nccl_pb2_grpc.add_NcclKvTransferServicer_to_server(
                    nccl, server
                ),
            ),
        ]
        self.server = start_kv_server(services, "127.0.0.1:0")
        self.port = self.server.port

    # -- commands --------------------------------------------------------------------------

    def cmd_hold(self, transfer_id: str, block_ids: list[int]) -> dict[str, Any]:
        if not self.holds.add(transfer_id, transfer_id, block_ids, 3600.0):
            return {"ok": False, "error": f"transfer {transfer_id} held already"}
        return {}

    def cmd_checksums(self, block_ids: list[int]) -> dict[str, Any]:
        idx = torch.tensor(block_ids, dtype=torch.long, device=f"cuda:{self.device}")
        total = torch.zeros(len(block_ids), dtype=torch.int64, device=idx.device)
        for layer, view in enumerate(self.transport.engine.mover.views):
            picked = view.index_select(1, idx).to(torch.int64)  # [outer, n, inner]
            per_block = (picked * self.weights).sum(dim=(0, 2))
            total = total * 31 + per_block * (layer + 1)
        return {"checksums": [int(x) for x in total.tolist()]}

    def cmd_pull(
        self,
        endpoint: str,
        transfer_id: str,
        block_indices: list[int],
        local_ids: list[int],
        timeout_s: float,
        remote_ids: list[int] | None = None,
        strategy: str | None = None,
        chunk_bytes: int | None = None,
    ) -> dict[str, Any]:
        request = PullRequest(
            transfer_id=transfer_id,
            remote_block_indices=block_indices,
            local_block_ids=local_ids,
            expected_layout=self.layout,
            requester_id=self.args.instance_id,
            deadline=time.monotonic() + timeout_s,
        )
        t0 = time.monotonic()
        try:
            result = self.transport.pull(
                self.peers.get(endpoint),
                request,
                remote_ids,
                Strategy.parse(strategy) if strategy else None,
                chunk_bytes,
                lambda: emit({"event": "recv_posted", "transfer_id": transfer_id}),
            )
        except TransferError as exc:
            return {
                "ok": False,
                "error": str(exc),
                "code": exc.code.name if exc.code else None,
                "elapsed_s": time.monotonic() - t0,
            }
        return {
            "bytes": result.nbytes,
            "elapsed_s": time.monotonic() - t0,
            "connect_s": result.connect_s,
            "post_s": result.post_s,
            "total_s": result.total_s,
        }

    def cmd_push(
        self, endpoint: str, items: list[dict[str, Any]], timeout_s: float
    ) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            session = self.transport.push_session(
                self.peers.get(endpoint),
                self.args.instance_id,
                [(it["transfer_id"], it["block_ids"]) for it in items],
                self.layout,
                time.monotonic() + timeout_s,
            )
            for layer in range(self.args.layers):
                session.send_layer(layer)
            nbytes = session.finish()
        except TransferError as exc:
            return {
                "ok": False,
                "error": str(exc),
                "code": exc.code.name if exc.code else None,
                "elapsed_s": time.monotonic() - t0,
            }
        return {"bytes": nbytes, "spilled": session.spilled, "elapsed_s": time.monotonic() - t0}

    def cmd_take(self, transfer_id: str, local_ids: list[int], timeout_s: float) -> dict[str, Any]:
        try:
            n = self.transport.receiver.take(transfer_id, local_ids, time.monotonic() + timeout_s)
        except TransferError as exc:
            return {"ok": False, "error": str(exc), "code": exc.code.name if exc.code else None}
        return {"bytes": n, "headroom": self.transport.receiver.gpu_headroom_bytes}

    def cmd_raw(
        self, peer: str, is_send: bool, nbytes: int, iters: int, timeout_s: float
    ) -> dict[str, Any]:
        comm = self.transport.engine.communicator(peer, 0)
        if comm is None:
            return {"ok": False, "error": f"no communicator with {peer}"}
        buf = torch.empty(nbytes + 8, dtype=torch.uint8, device=f"cuda:{self.device}")
        ptr = buf.data_ptr()
        times = []
        with comm.lock:
            for _ in range(iters):
                deadline = time.monotonic() + timeout_s
                # Both ranks leave this exchange together: the timed part starts in step.
                comm.enqueue(
                    [P2pOp(True, ptr + nbytes, 4), P2pOp(False, ptr + nbytes + 4, 4)], deadline
                )
                comm.wait(deadline)
                t0 = time.monotonic()
                comm.enqueue([P2pOp(is_send, ptr, nbytes)], deadline)
                comm.wait(deadline)
                times.append(time.monotonic() - t0)
        return {"times_s": times, "median_s": statistics.median(times)}

    def cmd_comms(self) -> dict[str, Any]:
        return {"comms": self.transport.engine.states()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--instance-id", required=True)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strategy", default="gather")
    p.add_argument("--chunk-bytes", type=int, default=64 << 20)
    p.add_argument("--push-gpu-bytes", type=int, default=64 << 20)
    p.add_argument("--push-host-bytes", type=int, default=64 << 20)
    args = p.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s"
    )
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks on demand (cluster.py)
    node = Node(args)
    emit({"port": node.port})
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        op = msg.pop("op")
        if op == "exit":
            break
        try:
            result = getattr(node, f"cmd_{op}")(**msg)
            emit({"ok": True, **result} if "ok" not in result else result)
        except Exception as exc:
            emit(
                {
                    "ok": False,
                    "error": f"{type(exc).__name__}: {exc}",
                    "trace": traceback.format_exc(),
                }
            )
    node.server.stop(1.0)
    node.transport.close()
    node.peers.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
