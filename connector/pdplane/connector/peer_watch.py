"""Which peers one worker should be connected to, from the registry: pre-connect and peers gone.

Each worker (TP rank) follows the registry (`pdplane.registry.client.InstanceWatcher`) and keeps
the set of *compatible* instances of the other role: same served model, transport, KV layout
fingerprint and TP size, role PREFILL for a decode (and DECODE for a prefill; BOTH counts as
both), not itself. Then:

* at start, before the instance registers, and whenever one appears later, the transport
  pre-connects (`KvTransport.preconnect`) to at most `preconnect_peers` of the serving ones, so
  that no request pays for the first contact (NCCL: ~0.4 s for a communicator). Which ones:
  the first in a rendezvous order (a hash of both instance ids), so that a fleet spreads its
  pre-connections instead of every prefill picking the same decodes;
* when one leaves the registry (REMOVED: killed and past its lease TTL, or drained and gone),
  `on_gone` drops what the worker keeps for it (communicators, channel, pushed KV, holds).

A DRAINING instance takes no new requests: it is not pre-connected to, and is dropped once it
is removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent import futures
from dataclasses import dataclass
from typing import Any

from pdplane.connector.transports.base import PeerInstance
from pdplane.core.instance.layout import fingerprint
from pdplane.v1 import instance_pb2

__all__ = ["PeerFollower", "PeerWatch", "WorkerIdentity", "rendezvous_order"]

log = logging.getLogger(__name__)

#: how long the start-up waits for the registry's first view before it gives up pre-connecting
_SNAPSHOT_WAIT_S = 5.0

_PREFILL = (instance_pb2.ROLE_PREFILL, instance_pb2.ROLE_BOTH)
_DECODE = (instance_pb2.ROLE_DECODE, instance_pb2.ROLE_BOTH)


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """What decides which registered instances this worker exchanges KV with."""

    instance_id: str
    role: instance_pb2.Role.ValueType
    model: str
    transport: instance_pb2.Transport.ValueType
    layout_fingerprint: str
    tp_size: int
    push: bool = False  # push mode: a prefill also pushes to its decodes


def rendezvous_order(me: str, peers: list[str]) -> list[str]:
    """`peers` in an order of their own for `me` (highest random weight hashing): each worker
    starts with different peers, so bounded pre-connections spread over the fleet."""

    def weight(peer: str) -> bytes:
        return hashlib.blake2b(f"{me}\0{peer}".encode(), digest_size=8).digest()

    return sorted(peers, key=weight)


class PeerWatch:
    """Follows the registry for one worker (see the module docstring).

    Args:
        me: this worker's identity.
        watcher: an `InstanceWatcher` built with `on_change=PeerWatch.on_change` (or anything
            with `start`, `stop`, `wait_ready(timeout)` and `snapshot()`).
        preconnect: called (on a thread of the watch) with peers to pre-connect to.
        on_gone: called (on a thread of the watch) with a peer that left the registry.
        limit: pre-connect to at most this many peers (`preconnect_peers`; 0 = none).
    """

    def __init__(
        self,
        me: WorkerIdentity,
        preconnect: Callable[[list[PeerInstance]], None],
        on_gone: Callable[[PeerInstance], None],
        limit: int,
    ) -> None:
        self.me = me
        self._preconnect = preconnect
        self.on_gone = on_gone
        self.limit = limit
        self._lock = threading.Lock()
        self._known: dict[str, PeerInstance] = {}  # compatible peers in the registry
        self._chosen: set[str] = set()  # pre-connected (or asked to)
        self._started = False
        self.gone = 0  # peers seen leaving (a counter for logs and tests)

    def peer_of(self, inst: instance_pb2.Instance) -> PeerInstance | None:
        """`inst` as a peer of this worker, or None when the two never exchange KV."""
        spec, me = inst.spec, self.me
        if spec.instance_id == me.instance_id or spec.model != me.model:
            return None
        if spec.transport != me.transport or spec.tp_size != me.tp_size:
            return None
        if fingerprint(spec.kv_layout) != me.layout_fingerprint:
            return None
        we_decode, we_prefill = me.role in _DECODE, me.role in _PREFILL
        it_prefills, it_decodes = spec.role in _PREFILL, spec.role in _DECODE
        pulls_from = we_decode and it_prefills
        serves_to = we_prefill and it_decodes
        if not (pulls_from or serves_to):
            return None
        return PeerInstance(
            spec.instance_id,
            spec.kv_endpoint,
            pulls_from=pulls_from,
            serves_to=serves_to,
            pushes_to=serves_to and me.push,
        )

    def initial(self, view: Mapping[str, instance_pb2.Instance]) -> list[PeerInstance]:
        """Takes the first view: returns the peers to pre-connect to now (bounded)."""
        with self._lock:
            self._started = True
            return self._update_locked(view)[0]

    def on_change(self, view: Mapping[str, instance_pb2.Instance]) -> None:
        """The watcher's callback: pre-connects to new peers, reports peers gone."""
        with self._lock:
            if not self._started:
                return  # `initial` takes the first view
            added, gone = self._update_locked(view)
        for peer in gone:
            self.gone += 1
            try:
                self.on_gone(peer)
            except Exception:
                log.exception("dropping what was kept for %s failed", peer.instance_id)
        if added:
            try:
                self._preconnect(added)
            except Exception:
                log.exception("pre-connect to %d peers failed", len(added))

    def _update_locked(
        self, view: Mapping[str, instance_pb2.Instance]
    ) -> tuple[list[PeerInstance], list[PeerInstance]]:
        current: dict[str, PeerInstance] = {}
        serving: set[str] = set()
        for inst in view.values():
            peer = self.peer_of(inst)
            if peer is not None:
                current[peer.instance_id] = peer
                if inst.state == instance_pb2.INSTANCE_STATE_SERVING:
                    serving.add(peer.instance_id)
        gone = [p for i, p in self._known.items() if i not in current]
        self._known = current
        self._chosen &= set(current)
        room = max(self.limit - len(self._chosen), 0)
        fresh = [
            i
            for i in rendezvous_order(self.me.instance_id, sorted(serving))
            if i not in self._chosen
        ]
        added = [current[i] for i in fresh[:room]]
        self._chosen.update(p.instance_id for p in added)
        return added, gone

    def known(self) -> dict[str, PeerInstance]:
        """The compatible peers in the registry now."""
        with self._lock:
            return dict(self._known)


class PeerFollower:
    """The threads around a `PeerWatch` for one worker: the registry watch, the start-up
    pre-connect (then `on_ready`), later pre-connects and drops, each on a thread of its own so
    that a slow handshake never delays a drop.

    Args:
        watch: what to do with the registry's view.
        watcher: an `InstanceWatcher` whose `on_change` is `watch.on_change`.
        preconnect: `KvTransport.preconnect`.
        timeout_s: bound on one pre-connect round (`preconnect_timeout_s`).
        on_ready: called once the start-up pre-connect is over (or given up).
    """

    def __init__(
        self,
        watch: PeerWatch,
        watcher: Any,
        preconnect: Callable[[list[PeerInstance], float], int],
        timeout_s: float,
        on_ready: Callable[[], None],
    ) -> None:
        self.watch = watch
        self.watcher = watcher
        self._preconnect = preconnect
        self._timeout_s = timeout_s
        self._on_ready = on_ready
        self._connects = futures.ThreadPoolExecutor(1, thread_name_prefix="pdplane-preconnect")
        self._drops = futures.ThreadPoolExecutor(1, thread_name_prefix="pdplane-peer-gone")
        self.ready = threading.Event()
        self.preconnected = 0  # pairs the start-up pre-connect opened

    def start(self) -> None:
        """Returns at once; `on_ready` runs when the start-up pre-connect is over."""
        threading.Thread(target=self._first_contact, name="pdplane-peers", daemon=True).start()

    def later(self, peers: list[PeerInstance]) -> None:
        """`PeerWatch`'s pre-connect callback: runs in the background."""
        deadline = time.monotonic() + self._timeout_s
        with contextlib.suppress(RuntimeError):  # shut down meanwhile
            self._connects.submit(self._preconnect, peers, deadline)

    def gone(self, on_gone: Callable[[PeerInstance], None]) -> Callable[[PeerInstance], None]:
        """Wraps `on_gone` to run on the drop thread."""

        def run(peer: PeerInstance) -> None:
            with contextlib.suppress(RuntimeError):
                self._drops.submit(on_gone, peer)

        return run

    def _first_contact(self) -> None:
        deadline = time.monotonic() + self._timeout_s
        try:
            self.watcher.start()
            view: Mapping[str, instance_pb2.Instance] = {}
            if self.watcher.wait_ready(min(_SNAPSHOT_WAIT_S, self._timeout_s)):
                view = self.watcher.snapshot()
            else:
                log.warning("no registry view in time: registering without pre-connect")
            peers = self.watch.initial(view)
            if peers:
                self.preconnected = self._preconnect(peers, deadline)
                log.info(
                    "pre-connected to %d of %d peers in %.1f s",
                    self.preconnected,
                    len(peers),
                    self._timeout_s - (deadline - time.monotonic()),
                )
        except Exception:
            log.exception("start-up pre-connect failed")
        finally:
            self.ready.set()
            self._on_ready()

    def stop(self) -> None:
        """Stops the watch and the background work (bounded)."""
        self.watcher.stop()
        self._connects.shutdown(wait=False, cancel_futures=True)
        self._drops.shutdown(wait=False, cancel_futures=True)
