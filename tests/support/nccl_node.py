"""A KV node for the NCCL tests and benchmark: one process owning a paged KV cache on a GPU.

The process builds a FlashAttention-layout KV cache (`[2, num_blocks, block_size, num_kv_heads,
head_size]` per layer, random contents), binds the `nccl` transport to it, serves the worker
server (`pdplane.v1.KvTransfer` and `pdplane.v1.NcclKvTransfer`) on 127.0.0.1 (port 0), prints
`{"port": N}` and then executes JSON commands read line by line from stdin, answering one JSON
line each on stdout:

  hold       {transfer_id, block_ids[, peer_id]}      -> prefill: hold blocks for a pull
  checksums  {block_ids}                              -> per-block checksums (all layers)
  pull       {endpoint, peer_id, transfer_id, block_indices, local_ids, timeout_s
              [, chunk_bytes]}  -> decode: one pull, with its timing
  pulls      {pulls: [pull args...], concurrency}     -> decode: pulls at once, each answered
  push       {endpoint, peer_id, items: [{transfer_id, block_ids}], timeout_s}
  take       {transfer_id, local_ids, timeout_s}      -> decode: copy a pushed transfer in
  raw        {peer, is_send, nbytes, iters, timeout_s} -> plain NCCL send/recv on the pair
  preconnect {peers: [{instance_id, endpoint, pulls_from, serves_to, pushes_to}], timeout_s}
  drop       {peer_id}                                -> drop a peer as if it left the registry
  deregister {drain}                                  -> leave the registry (with --registry)
  comms      {}                                       -> pairs, their states and counters
  serve_timings {}                                    -> prefill's side of the pulls it served
  exit       {}

With `--registry`, the node registers itself (role `--role`) and follows the registry like a
connector worker: it pre-connects to the instances of the other role and drops those that
leave (events `peer_gone`). Events (not answers) are lines with an "event" key, e.g.
{"event": "send_started"}. Run with distinct NCCL_HOSTID per process when two share one GPU.
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
from concurrent import futures
from dataclasses import asdict
from typing import Any

import torch

from pdplane.connector.holds import HoldTable
from pdplane.connector.kv_cache import KvCacheView
from pdplane.connector.peer_watch import PeerFollower, PeerWatch, WorkerIdentity
from pdplane.connector.peers import PeerPool
from pdplane.connector.server import HoldAccess, start_kv_server, worker_services
from pdplane.connector.transports.base import (
    LocalWorker,
    PeerInstance,
    PullRequest,
    TransferError,
)
from pdplane.connector.transports.nccl import NcclTransport
from pdplane.connector.transports.nccl.communicator import P2pOp
from pdplane.connector.transports.nccl.pairs import PairKey, Purpose
from pdplane.core.instance.layout import fingerprint
from pdplane.v1 import instance_pb2

_out_lock = threading.Lock()
_ROLES = {"prefill": instance_pb2.ROLE_PREFILL, "decode": instance_pb2.ROLE_DECODE}


def emit(obj: dict[str, Any]) -> None:
    with _out_lock:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


def _failed(exc: TransferError, t0: float) -> dict[str, Any]:
    return {
        "ok": False,
        "error": str(exc),
        "code": exc.code.name if exc.code else None,
        "elapsed_s": time.monotonic() - t0,
    }


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
            nccl_chunk_bytes=args.chunk_bytes,
            max_peer_communicators=args.max_peer_communicators,
            push_buffer_bytes=args.push_gpu_bytes,
            push_spill_bytes=args.push_host_bytes,
        )
        self.peers = PeerPool()
        local = LocalWorker(args.instance_id, "", 0)
        self.transport.bind(KvCacheView(caches, args.num_blocks), self.peers, local)
        self.engine = self.transport.engine
        self.engine.on_send = lambda tid: emit({"event": "send_started", "transfer_id": tid})
        wgen = torch.Generator(device=f"cuda:{self.device}").manual_seed(1234)
        inner = int(self.engine.mover.views[0].shape[2])
        self.weights = torch.randint(
            1, 1 << 20, (inner,), dtype=torch.int64, device=f"cuda:{self.device}", generator=wgen
        )
        self.holds = HoldTable()
        access = HoldAccess(self.holds, self.layout)
        self.server = start_kv_server(
            worker_services(self.transport, access), "127.0.0.1:0", ready=not args.registry
        )
        self.port = self.server.port
        self.endpoint = f"127.0.0.1:{self.port}"
        self.transport.local = LocalWorker(args.instance_id, self.endpoint, 0)
        self.gone: list[dict[str, Any]] = []
        self.follower: PeerFollower | None = None
        self.registration: Any = None
        if args.registry:
            self._follow(args.registry)

    def _follow(self, registry: str) -> None:
        from pdplane.registry.client import InstanceWatcher, RegistrationClient

        role = _ROLES[self.args.role]
        me = WorkerIdentity(
            self.args.instance_id,
            role,
            "bench",
            instance_pb2.TRANSPORT_NCCL,
            fingerprint(self.layout),
            1,
        )
        watch = PeerWatch(me, lambda peers: follower.later(peers), lambda p: None, 64)
        watcher = InstanceWatcher(registry, on_change=watch.on_change)
        follower = PeerFollower(
            watch, watcher, self.transport.preconnect, 30.0, lambda: self.server.set_ready(True)
        )
        watch.on_gone = follower.gone(self._peer_gone)
        self.follower = follower
        follower.start()
        spec = instance_pb2.InstanceSpec(
            instance_id=self.args.instance_id,
            role=role,
            model="bench",
            url="http://127.0.0.1:1",
            kv_endpoint=self.endpoint,
            transport=instance_pb2.TRANSPORT_NCCL,
            tp_size=1,
            kv_layout=self.layout,
            max_model_len=1 << 20,
            version="bench",
        )
        self.registration = RegistrationClient(registry, spec, lease_ttl_ms=self.args.lease_ttl_ms)
        follower.ready.wait(35)
        self.registration.start()

    def _peer_gone(self, peer: PeerInstance) -> None:
        t0 = time.monotonic()
        dropped = self.transport.peer_gone(peer)
        self.peers.drop(peer.kv_endpoint)
        logging.getLogger("nccl_node").warning(
            "peer %s left the registry: dropped %s", peer.instance_id, dropped
        )
        event = {"event": "peer_gone", "peer": peer.instance_id, "dropped": dropped}
        self.gone.append({**event, "drop_s": time.monotonic() - t0})
        emit(event)

    # -- commands --------------------------------------------------------------------------

    def cmd_hold(self, transfer_id: str, block_ids: list[int], peer_id: str = "") -> dict[str, Any]:
        if not self.holds.add(transfer_id, transfer_id, block_ids, 3600.0, peer_id):
            return {"ok": False, "error": f"transfer {transfer_id} held already"}
        return {}

    def cmd_checksums(self, block_ids: list[int]) -> dict[str, Any]:
        idx = torch.tensor(block_ids, dtype=torch.long, device=f"cuda:{self.device}")
        total = torch.zeros(len(block_ids), dtype=torch.int64, device=idx.device)
        for layer, view in enumerate(self.engine.mover.views):
            picked = view.index_select(1, idx).to(torch.int64)  # [outer, n, inner]
            per_block = (picked * self.weights).sum(dim=(0, 2))
            total = total * 31 + per_block * (layer + 1)
        return {"checksums": [int(x) for x in total.tolist()]}

    def cmd_pull(
        self,
        endpoint: str,
        peer_id: str,
        transfer_id: str,
        block_indices: list[int],
        local_ids: list[int],
        timeout_s: float,
        chunk_bytes: int | None = None,
    ) -> dict[str, Any]:
        request = PullRequest(
            transfer_id=transfer_id,
            remote_block_indices=block_indices,
            local_block_ids=local_ids,
            expected_layout=self.layout,
            requester_id=self.args.instance_id,
            peer_id=peer_id,
            deadline=time.monotonic() + timeout_s,
        )
        t0 = time.monotonic()
        try:
            t = self.transport.pull_timed(
                self.peers.get(endpoint),
                request,
                chunk_bytes,
                lambda: emit({"event": "recv_posted", "transfer_id": transfer_id}),
            )
        except TransferError as exc:
            return _failed(exc, t0)
        return {
            "bytes": t.nbytes,
            "elapsed_s": time.monotonic() - t0,
            **{k: v for k, v in asdict(t).items() if k != "nbytes"},
        }

    def cmd_pulls(self, pulls: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
        with futures.ThreadPoolExecutor(concurrency) as pool:
            answers = list(pool.map(lambda kw: self.cmd_pull(**kw), pulls))
        return {"answers": answers, "failed": sum(a.get("ok") is False for a in answers)}

    def cmd_push(
        self, endpoint: str, items: list[dict[str, Any]], timeout_s: float, peer_id: str = ""
    ) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            session = self.transport.push_session(
                self.peers.get(endpoint),
                self.args.instance_id,
                [(it["transfer_id"], it["block_ids"]) for it in items],
                self.layout,
                time.monotonic() + timeout_s,
                peer_id=peer_id,
            )
            for layer in range(self.args.layers):
                session.send_layer(layer)
            nbytes = session.finish()
        except TransferError as exc:
            return _failed(exc, t0)
        return {"bytes": nbytes, "spilled": session.spilled, "elapsed_s": time.monotonic() - t0}

    def cmd_take(self, transfer_id: str, local_ids: list[int], timeout_s: float) -> dict[str, Any]:
        receiver = self.transport.receiver
        try:
            n = receiver.take(transfer_id, local_ids, time.monotonic() + timeout_s)
        except TransferError as exc:
            return {"ok": False, "error": str(exc), "code": exc.code.name if exc.code else None}
        return {"bytes": n, "headroom": receiver.gpu_headroom_bytes}

    def cmd_raw(
        self, peer: str, is_send: bool, nbytes: int, iters: int, timeout_s: float
    ) -> dict[str, Any]:
        pair = self.engine.pairs.get(PairKey(peer, 0, Purpose.PULL))
        if pair is None:
            return {"ok": False, "error": f"no pair with {peer}"}
        comm = pair.comm
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

    def cmd_preconnect(self, peers: list[dict[str, Any]], timeout_s: float) -> dict[str, Any]:
        t0 = time.monotonic()
        wanted = [
            PeerInstance(
                p["instance_id"],
                p["endpoint"],
                bool(p.get("pulls_from")),
                bool(p.get("serves_to")),
                bool(p.get("pushes_to")),
            )
            for p in peers
        ]
        opened = self.transport.preconnect(wanted, time.monotonic() + timeout_s)
        return {"opened": opened, "elapsed_s": time.monotonic() - t0}

    def cmd_drop(self, peer_id: str) -> dict[str, Any]:
        return {"dropped": self.transport.peer_gone(PeerInstance(peer_id, ""))}

    def cmd_deregister(self, drain: bool = False) -> dict[str, Any]:
        """Leaves the registry (with `drain`: DRAINING first, gone once idle)."""
        if self.registration is None:
            return {"ok": False, "error": "not registered (no --registry)"}
        self.registration.stop(drain=drain, drain_timeout=5.0)
        return {}

    def cmd_comms(self) -> dict[str, Any]:
        return {"comms": self.engine.states(), "stats": self.engine.stats(), "gone": self.gone}

    def cmd_serve_timings(self) -> dict[str, Any]:
        return {"timings": [asdict(t) for t in self.engine.serve_timings]}

    def close(self) -> None:
        if self.registration is not None:
            self.registration.stop()  # idempotent
        if self.follower is not None:
            self.follower.stop()
        self.server.stop(1.0)
        self.transport.close()
        self.peers.close()


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
    p.add_argument("--chunk-bytes", type=int, default=64 << 20)
    p.add_argument("--push-gpu-bytes", type=int, default=64 << 20)
    p.add_argument("--push-host-bytes", type=int, default=64 << 20)
    p.add_argument("--max-peer-communicators", type=int, default=64)
    p.add_argument("--registry", default="")
    p.add_argument("--role", choices=sorted(_ROLES), default="decode")
    p.add_argument("--lease-ttl-ms", type=int, default=2000)
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
    node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
