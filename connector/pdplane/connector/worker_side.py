"""Worker-side half of the connector: one per worker (TP rank), inside vLLM's worker process.

Serves the KV blocks this worker holds for remote decodes (the worker's gRPC server: the
shared `KvTransfer` service plus the transport's own), runs the pulls (and, in push mode, the
pushes) the scheduler side asks for, and answers vLLM's per-step questions (`get_finished`,
`get_block_ids_with_load_errors`, `stats`) from in-memory state without blocking.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace

import torch

from pdplane.connector.config import ConnectorConfig
from pdplane.connector.holds import HoldTable
from pdplane.connector.kv_cache import KvCacheView
from pdplane.connector.kv_events import KvEventsReader
from pdplane.connector.metadata import METADATA_VERSION, PdPlaneConnectorMetadata
from pdplane.connector.peer_watch import PeerFollower, PeerWatch, WorkerIdentity
from pdplane.connector.peers import PeerPool
from pdplane.connector.pulls import Puller
from pdplane.connector.pushes import Pusher
from pdplane.connector.server import HoldAccess, KvServer, start_kv_server, worker_services
from pdplane.connector.stats import COUNTERS, GAUGES, PdPlaneKvStats, rank_stats
from pdplane.connector.transports import KvTransport, create_transport
from pdplane.connector.transports.base import LocalWorker, PeerInstance, ServiceBinding
from pdplane.connector.vllm_info import ROLES
from pdplane.core.instance.layout import fingerprint
from pdplane.core.kv_events.log import KvEventLog
from pdplane.core.kv_events.servicer import SERVICE_NAME as KV_EVENTS_SERVICE
from pdplane.core.kv_events.servicer import add_kv_events_servicer
from pdplane.core.tokenizer.servicer import SERVICE_NAME as TOKENIZER_SERVICE
from pdplane.core.tokenizer.servicer import Published, add_tokenizer_servicer
from pdplane.registry.client import InstanceWatcher
from pdplane.v1 import instance_pb2

__all__ = ["WorkerSide"]

log = logging.getLogger(__name__)

_SERVER_GRACE_S = 2.0
_KV_EVENTS_STREAMS = 8  # threads for KvEvents subscribers (StreamOptions.max_subscribers)
_TOKENIZER_FETCHES = 4  # threads for TokenizerFiles fetches (the service's own bound)


class WorkerSide:
    """Holds, pulls and the KvTransfer server of one worker.

    Args:
        config: the connector settings.
        layout: this worker's KV layout.
        instance_id: this instance's registry id (the requester id in pulls).
        tp_rank: this worker's tensor-parallel rank.
        num_blocks: KV cache blocks per layer (to find the block axis); None = first axis.
        transport: the byte mover; default: the one named in `config.transport`.
        kv_events_endpoint: where vLLM publishes its KV cache events (`kv_events.
            reader_endpoint`); rank 0 reads them and serves `pdplane.v1.KvEvents` next to
            KvTransfer. None = no events.
        role: vLLM's kv_role; model: the served model name; tp_size: the instance's TP size
            (which registered instances are this worker's peers, see peer_watch.py).
        tokenizer: what the instance publishes of its tokenizer (`pdplane.connector.tokenizer`;
            rank 0 serves `pdplane.v1.TokenizerFiles`); None = the service is not offered.
    """

    def __init__(
        self,
        config: ConnectorConfig,
        layout: instance_pb2.KvLayout,
        instance_id: str,
        tp_rank: int = 0,
        num_blocks: int | None = None,
        transport: KvTransport | None = None,
        kv_events_endpoint: str | None = None,
        kv_events_topic: str = "",
        role: str = "kv_both",
        model: str = "",
        tp_size: int = 1,
        tokenizer: Published | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer if tp_rank == 0 else None
        self.instance_id = instance_id
        self.identity = WorkerIdentity(
            instance_id,
            ROLES.get(role, instance_pb2.ROLE_BOTH),
            model,
            config.registry_transport,
            fingerprint(layout),
            tp_size,
            push=config.mode == "push",
        )
        self.follower: PeerFollower | None = None
        self.layout = layout
        self.tp_rank = tp_rank
        self.num_blocks = num_blocks
        if transport is None:
            transport = create_transport(config.transport, **config.transport_options())
        self.transport = transport
        self.holds = HoldTable()
        self.peers = PeerPool(config.token, config.tls_ca)
        self.puller = Puller(
            transport,
            self.peers,
            layout,
            requester_id=instance_id,
            tp_rank=tp_rank,
            pull_timeout_s=config.pull_timeout_s,
            max_workers=config.pull_workers,
            push_wait_s=config.push_wait_s,
        )
        self.pusher = Pusher(
            transport,
            self.peers,
            layout,
            sender_id=instance_id,
            tp_rank=tp_rank,
            timeout_s=config.push_timeout_s,
        )
        self.server: KvServer | None = None
        self.port = 0
        self._last_seq = 0
        self._reported: dict[str, int] = {}  # gauges of the last stats report
        self._counted: dict[str, int] = {}  # counters as of the last stats report
        self.peers_gone = 0  # peers that left the registry while this worker knew them
        self.kv_events: KvEventsReader | None = None
        if kv_events_endpoint and tp_rank == 0:  # one stream per engine, on rank 0's server
            self.kv_events = KvEventsReader(kv_events_endpoint, KvEventLog(), kv_events_topic)

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Binds the KV cache tensors and starts the KvTransfer server on
        `config.bind_address(tp_rank)`. Raises RuntimeError if the port cannot be bound."""
        self.cache = KvCacheView(kv_caches, self.num_blocks)
        local = LocalWorker(self.instance_id, self.config.kv_endpoint(self.tp_rank), self.tp_rank)
        self.transport.bind(self.cache, self.peers, local)
        self.pusher.bind_layers(list(kv_caches))
        access = HoldAccess(self.holds, self.layout, tombstone_s=self.config.transfer_timeout_s)
        services = worker_services(self.transport, access)
        events = self.kv_events
        if events is not None:
            services.append(
                ServiceBinding(
                    KV_EVENTS_SERVICE,
                    lambda server: add_kv_events_servicer(server, events.log),
                    threads=_KV_EVENTS_STREAMS,
                )
            )
        published = self.tokenizer
        if published is not None:
            services.append(
                ServiceBinding(
                    TOKENIZER_SERVICE,
                    lambda server: add_tokenizer_servicer(server, published),
                    threads=_TOKENIZER_FETCHES,
                )
            )
        self.server = start_kv_server(
            services,
            self.config.bind_address(self.tp_rank),
            token=self.config.token,
            tls_cert=self.config.tls_cert,
            tls_key=self.config.tls_key,
            ready=not self.config.registry,  # with a registry: once pre-connected
        )
        self.port = self.server.port
        if not self.config.kv_port:  # any port: peers reach the one bound
            host = self.config.kv_endpoint(self.tp_rank).rpartition(":")[0]
            self.transport.local = replace(local, endpoint=f"{host}:{self.port}")
        if events is not None:
            events.start()
        if self.config.registry:
            self._follow_peers()
        log.info(
            "KvTransfer server of rank %d on port %d (%s transport, %d layers)",
            self.tp_rank,
            self.port,
            self.transport.name,
            len(kv_caches),
        )

    def _follow_peers(self) -> None:
        config, server = self.config, self.server
        assert config.registry is not None and server is not None
        watch = PeerWatch(
            self.identity,
            lambda peers: follower.later(peers),
            lambda peer: None,
            config.preconnect_peers,
        )
        watcher = InstanceWatcher(
            config.registry,
            token=config.registry_token,
            tls_ca=config.registry_tls_ca,
            on_change=watch.on_change,
        )
        follower = PeerFollower(
            watch,
            watcher,
            self.transport.preconnect,
            config.preconnect_timeout_s,
            lambda: server.set_ready(True),
        )
        watch.on_gone = follower.gone(self.peer_gone)
        self.follower = follower
        follower.start()

    def peer_gone(self, peer: PeerInstance) -> None:
        """`peer` left the registry (killed: its lease expired; drained: it went): drops its
        communicators and pushed KV (transport), its channel, and the holds meant for it."""
        dropped = self.transport.peer_gone(peer)
        channel = self.peers.drop(peer.kv_endpoint, self.tp_rank)
        holds = self.holds.release_peer(peer.instance_id, f"decode {peer.instance_id} left")
        self.peers_gone += 1
        log.warning(
            "peer %s left the registry: dropped %s, %s, %d holds",
            peer.instance_id,
            ", ".join(f"{n} {what}" for what, n in dropped.items()) or "nothing of the transport",
            "its channel" if channel else "no channel",
            holds,
        )

    def handle_metadata(self, meta: PdPlaneConnectorMetadata) -> None:
        """Acts on one step's metadata (each step once, however often vLLM binds it)."""
        if meta.seq and meta.seq <= self._last_seq:
            return
        self._last_seq = meta.seq
        if meta.version != METADATA_VERSION:
            raise RuntimeError(f"connector metadata v{meta.version} != v{METADATA_VERSION}")
        for hold in meta.holds:
            if not self.holds.add(
                hold.req_id, hold.transfer_id, hold.block_ids, hold.timeout_s, hold.decode_id
            ):
                log.error("transfer %s: request %s held twice", hold.transfer_id, hold.req_id)
        for load in meta.loads:
            self.puller.submit(load)
        for release in meta.releases:
            self.puller.release(release)
        if meta.pushes:
            self.pusher.start(meta.pushes)

    def save_kv_layer(self, layer_name: str) -> None:
        """Push mode: layer `layer_name` of this step's forward is written; push it."""
        self.pusher.save_layer(layer_name)

    def wait_for_save(self) -> None:
        """Push mode: the forward is over; close this step's push sessions."""
        if self.pusher.active:
            self.pusher.finish()

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """(finished sending, finished receiving) vLLM request ids since the last call."""
        buffer = self.transport.receive_buffer
        if buffer is not None:
            buffer.expire()
        return self.holds.pop_finished() or None, self.puller.pop_finished() or None

    def gauges(self) -> dict[str, int]:
        """This worker's gauges and counters since start (names of `stats.GAUGES` and
        `stats.COUNTERS`): push receive buffer (bytes; only in push mode), bytes of one KV
        cache block over all layers, channels, and the transport's own."""
        out = dict(self.transport.stats())
        out["peers_gone"] = self.peers_gone
        out["peer_channels"] = len(self.peers)
        buffer = self.transport.receive_buffer
        if self.config.mode == "push" and buffer is not None:
            out["push_capacity_bytes"] = buffer.capacity_bytes
            out["push_headroom_bytes"] = buffer.headroom_bytes
        cache = getattr(self, "cache", None)
        if cache is not None:
            out["kv_block_bytes"] = sum(lc.block_nbytes for lc in cache.layers)
        return out

    def stats(self) -> PdPlaneKvStats | None:
        """vLLM's `get_kv_connector_stats` (every engine step): the gauges when they changed
        since the last report and the counters' increments, else None (cheap: a few integer
        reads)."""
        now = self.gauges()
        gauges = {k: v for k, v in now.items() if k in GAUGES}
        counters = {k: now[k] - self._counted.get(k, 0) for k in COUNTERS if k in now}
        counters = {k: n for k, n in counters.items() if n}
        if gauges == self._reported and not counters:
            return None
        self._reported = gauges
        self._counted.update({k: now[k] for k in COUNTERS if k in now})
        return rank_stats(self.tp_rank, gauges, counters)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.puller.pop_load_errors()

    def shutdown(self) -> None:
        """Stops the server, pushes and pulls; idempotent."""
        self.pusher.close()
        self.puller.close()
        if self.follower is not None:
            self.follower.stop()
        if self.kv_events is not None:
            self.kv_events.stop()  # closes the log: open KvEvents streams end UNAVAILABLE
        if self.server is not None:
            self.server.stop(_SERVER_GRACE_S)
            self.server = None
        self.peers.close()
        self.transport.close()
