"""Prefill side of push mode: one engine step's pushes, driven by vLLM's per-layer hooks.

The step's metadata names the prompts computed in this step whose decode is known
(`PushSpec`); before the forward, `start` opens one push session per decode endpoint through
the transport; after each attention layer, `save_layer` (vLLM's `save_kv_layer`) sends that
layer's blocks; at the end of the forward, `finish` (vLLM's `wait_for_save`) closes the
sessions. Nothing here reports to vLLM: prefill holds the blocks exactly as in pull mode, so a
push that fails (decode's buffer full, decode gone, timeout) only means decode pulls them.
Runs on the engine thread; every call is bounded by the push deadline.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence

from pdplane.connector.metadata import PushSpec
from pdplane.connector.peers import PeerPool
from pdplane.connector.transports.base import KvTransport, PushSender, TransferError
from pdplane.v1 import instance_pb2

__all__ = ["Pusher"]

log = logging.getLogger(__name__)


class Pusher:
    """Pushes of one prefill worker (TP rank).

    Args:
        transport: moves the bytes (its `push_session`).
        peers: channels to decode instances.
        layout: this worker's KV layout (decode checks it).
        sender_id: this instance's registry id.
        tp_rank: this worker's TP rank (pushes to the same rank of decode).
        timeout_s: bound on one step's push sessions (s).
    """

    def __init__(
        self,
        transport: KvTransport,
        peers: PeerPool,
        layout: instance_pb2.KvLayout,
        sender_id: str,
        tp_rank: int = 0,
        timeout_s: float = 10.0,
    ) -> None:
        self._transport = transport
        self._peers = peers
        self._layout = layout
        self._sender_id = sender_id
        self._tp_rank = tp_rank
        self._timeout_s = timeout_s
        self._layer_index: dict[str, int] = {}
        self._sessions: list[PushSender] = []
        self.started = 0  # sessions opened (a counter for logs and tests)

    def bind_layers(self, layer_names: Sequence[str]) -> None:
        """The KV cache layer names in cache order (vLLM's `save_kv_layer` names a layer)."""
        self._layer_index = {name: i for i, name in enumerate(layer_names)}

    @property
    def active(self) -> bool:
        return bool(self._sessions)

    def start(self, specs: Sequence[PushSpec]) -> None:
        """Opens this step's push sessions (one per decode endpoint). A session that cannot
        open is logged and skipped: decode will pull those blocks."""
        if self._sessions:  # a step whose forward never reached wait_for_save
            self.finish()
        by_endpoint: dict[str, list[tuple[str, Sequence[int]]]] = defaultdict(list)
        peer_ids: dict[str, str] = {}
        for spec in specs:
            by_endpoint[spec.endpoint].append((spec.transfer_id, spec.block_ids))
            if spec.decode_id:
                peer_ids[spec.endpoint] = spec.decode_id
        deadline = time.monotonic() + self._timeout_s
        for endpoint, items in by_endpoint.items():
            try:
                peer = self._peers.get(endpoint, self._tp_rank)
                session = self._transport.push_session(
                    peer,
                    self._sender_id,
                    items,
                    self._layout,
                    deadline,
                    self._tp_rank,
                    peer_ids.get(endpoint, ""),
                )
            except TransferError as exc:
                log.info("push of %d transfers to %s not started: %s", len(items), endpoint, exc)
                continue
            except Exception:  # a broken push must never break the forward
                log.exception("push of %d transfers to %s not started", len(items), endpoint)
                continue
            self._sessions.append(session)
            self.started += 1

    def save_layer(self, layer_name: str) -> None:
        """Sends layer `layer_name` of every open session (its KV was just written)."""
        if not self._sessions:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return  # not a layer of this cache (e.g. a cross-attention layer)
        for session in list(self._sessions):
            try:
                session.send_layer(layer)
            except Exception as exc:  # a broken push must never break the forward
                log.info("push of layer %s failed: %s; decode will pull", layer_name, exc)
                session.abort(str(exc))
                self._sessions.remove(session)

    def finish(self) -> None:
        """Closes this step's sessions (bounded by their deadline)."""
        sessions, self._sessions = self._sessions, []
        for session in sessions:
            try:
                session.finish()
            except Exception as exc:
                log.info("push did not finish: %s; decode will pull", exc)

    def close(self) -> None:
        """Aborts whatever is still open (connector shutdown)."""
        sessions, self._sessions = self._sessions, []
        for session in sessions:
            session.abort("shutting down")
