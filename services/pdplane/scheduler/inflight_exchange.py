"""Several replicas deciding over one fleet share their in-flight assignments.

Each replica (a `pdplane scheduler` process, or a gateway with `--scheduler embedded`) serves
`pdplane.v1.InflightExchange` and subscribes to every peer named in `--peers`. A subscription
streams the publisher's assignments: a snapshot of those in flight, then every change (ASSIGNED
on Schedule, RELEASED on Release, retry or expiry) batched per event-loop turn, in order. The
subscriber counts a peer's ASSIGNED exactly as its own decision made at the moment it arrives
(`InflightTracker.add_peer`): pending on the load reports its own view holds then, so it stops
counting as load when those instances next report, by the same rule as its own assignments.

Consistency: every replica sees every other's assignments one stream hop after they were made;
there is no global order. The hop is short (a network round trip plus an event-loop turn), but a
burst decides faster than that: a gateway deciding itself makes dozens of decisions in one loop
turn, before its first update leaves, so replicas that counted only what they had received would
still herd. For that window each replica assumes that its peers decide as it does:
an own assignment also counts once per followed peer as "unseen" load on its instances until
the second update from that peer since the assignment has arrived (the first may have left
before it), by which time the peer's real decisions count instead; at most `lag_s`
(`--peer-lag-ms`). A replica with nothing to send sends an empty update every 10 ms, so the
estimate of an idle peer ends within about two ticks, and that of a peer too busy to send
lasts as long as it is silent. Within that window the estimate is conservative (a peer's real
choice and the guess can both count). Measured on the burst scenario (docs/scheduler.md):
without the estimate, embedded gateways sharing assignments still herded (burst [90, 10, 10,
10]: the first update arrived ~30 ms after 27 decisions); with it, [60, 20, 20, 20].

Peers are `host:port` gRPC addresses; a name that resolves to several addresses (a headless
Kubernetes Service of the replicas) counts as one peer per address, re-resolved every
`resolve_every_s` so that scaled replicas join.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import threading
from collections.abc import AsyncIterator, Sequence

import grpc
from prometheus_client import CollectorRegistry, Gauge

from pdplane.core.grpc import util as grpc_util
from pdplane.scheduler.inflight import Assignment, InflightTracker
from pdplane.scheduler.inflight_servicer import SERVICE_NAME, InflightExchangeServicer
from pdplane.scheduler.unseen import UnseenPeers
from pdplane.scheduler.view import CandidateView
from pdplane.v1 import inflight_pb2, inflight_pb2_grpc

__all__ = [
    "EmbeddedExchange",
    "InflightExchange",
    "default_replica_id",
    "serve_exchange",
]

log = logging.getLogger(__name__)

_ASSIGNED = inflight_pb2.InflightEvent.KIND_ASSIGNED
_RELEASED = inflight_pb2.InflightEvent.KIND_RELEASED
_QUEUE_UPDATES = 10_000  # updates a subscriber may lag before it is cut off (it resubscribes)
_BACKOFF_S = (0.05, 2.0)  # reconnect delay to a peer: first, longest (doubling)
_TICK_S = 0.01  # an idle replica's empty update to its subscribers, every this many seconds


def default_replica_id() -> str:
    """`<hostname>-<pid>-<6 hex>`: unique per process, readable in logs."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class _Subscriber:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[list[inflight_pb2.InflightEvent]] = asyncio.Queue(_QUEUE_UPDATES)
        self.overflowed = False


class InflightExchange:
    """Publishes `tracker`'s own assignments to subscribers and feeds peers' into it.

    `view` resolves a peer's instance ids to this replica's current candidates (their report
    epochs). `peers` are gRPC addresses of the other replicas' exchanges; `token` / `tls_ca`
    are sent to / verify them. Add `servicer` to the replica's gRPC server, then `await
    start()` on the event loop that serves it; `await stop()` ends the subscriptions.
    """

    def __init__(
        self,
        tracker: InflightTracker,
        view: CandidateView,
        *,
        replica_id: str | None = None,
        peers: Sequence[str] = (),
        token: str | None = None,
        tls_ca: str | None = None,
        resolve_every_s: float = 5.0,
        lag_s: float = 1.0,
        tick_s: float = _TICK_S,
    ) -> None:
        self.tracker = tracker
        self.view = view
        self.replica_id = replica_id or default_replica_id()
        self.peers = tuple(p for p in peers if p)
        self._token = token
        self._tls_ca = tls_ca
        self._resolve_every_s = resolve_every_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._outbox: list[inflight_pb2.InflightEvent] = []
        self._flush_scheduled = False
        self._subscribers: set[_Subscriber] = set()
        self._followers: dict[str, asyncio.Task[None]] = {}
        self._skip: set[str] = set()  # addresses of this replica, or of a peer already followed
        self._resolver: asyncio.Task[None] | None = None
        self.connected: dict[str, str] = {}  # peer address -> its replica id, while streaming
        self.servicer = InflightExchangeServicer(self.subscribe)
        self._lag_s = lag_s
        self._tick_s = tick_s
        self._ticker: asyncio.Task[None] | None = None
        # Own recent assignments standing for the peers' decisions not received yet.
        self._unseen = UnseenPeers(self.connected.values, lag_s)

    def register_metrics(self, registry: CollectorRegistry) -> None:
        """Adds `pdplane_scheduler_peers` (peer replicas followed now, read at scrape time) and
        `pdplane_scheduler_subscribers` (replicas following this one) to `registry`."""
        Gauge(
            "pdplane_scheduler_peers",
            "Peer replicas whose in-flight assignments this one follows now",
            registry=registry,
        ).set_function(lambda: len(self.connected))
        Gauge(
            "pdplane_scheduler_subscribers",
            "Replicas following this one's in-flight assignments now",
            registry=registry,
        ).set_function(lambda: len(self._subscribers))

    async def start(self) -> None:
        """Starts publishing own changes and following the peers (on the running loop)."""
        self._loop = asyncio.get_running_loop()
        self.tracker.listener = self._on_change
        self._unseen.touch = self.tracker.touch
        self.tracker.unseen = self._unseen
        if self.peers:
            self._resolver = asyncio.create_task(self._resolve_forever())
        self._ticker = asyncio.create_task(self._tick_forever())

    async def stop(self) -> None:
        """Stops following peers (their assignments are dropped) and ends subscriptions."""
        self.tracker.listener = None
        self.tracker.unseen = None
        self._unseen.touch = None
        self.tracker.touch(self._unseen.counted())  # their table rows lose the estimate
        tasks = [
            t for t in (self._resolver, self._ticker, *self._followers.values()) if t is not None
        ]
        self._resolver = self._ticker = None
        self._followers.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sub in self._subscribers:
            sub.overflowed = True
            with contextlib.suppress(asyncio.QueueFull):
                sub.queue.put_nowait([])

    # --- publishing ----------------------------------------------------------------------

    def unseen(self, instance_id: str) -> float:
        """Peers' assignments to `instance_id` estimated but not received yet: each own one
        counts once per followed peer until the second update from that peer since it was made
        has arrived (the first may have left before it), at most `lag_s` seconds (module
        docstring, `pdplane.scheduler.unseen`). Zero without peers."""
        self._unseen.refresh()
        return float(self._unseen.count(instance_id))

    def _on_change(self, assigned: list[Assignment], released: list[Assignment]) -> None:
        if self.connected:
            for a in assigned:
                self._unseen.assigned((a.prefill_id, a.decode_id))
        if not self._subscribers:
            return  # a later subscriber starts from a snapshot
        # Releases first: a retry replaces an id by releasing, then assigning it again.
        events = [
            inflight_pb2.InflightEvent(kind=_RELEASED, request_id=r.request_id) for r in released
        ]
        events += [_assigned(a) for a in assigned]
        with self._lock:
            self._outbox.extend(events)
            if self._flush_scheduled or self._loop is None:
                return
            self._flush_scheduled = True
        self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            events, self._outbox = self._outbox, []
            self._flush_scheduled = False
        if not events:
            return
        for sub in self._subscribers:
            try:
                sub.queue.put_nowait(events)
            except asyncio.QueueFull:
                sub.overflowed = True

    async def _tick_forever(self) -> None:
        # An empty update every tick_s tells the subscribers that nothing was decided since
        # the last one, so their estimate of this replica's unseen decisions can end.
        while True:
            await asyncio.sleep(self._tick_s)
            for sub in self._subscribers:
                if sub.queue.empty():
                    sub.queue.put_nowait([])

    async def subscribe(self, subscriber_id: str) -> AsyncIterator[inflight_pb2.InflightUpdate]:
        """The updates of one subscription (see the module docstring). Raises ValueError when
        `subscriber_id` is this replica's own id; ends when the subscriber lags too far."""
        if subscriber_id == self.replica_id:
            raise ValueError(f"replica {subscriber_id!r} subscribed to itself")
        # Changes not yet flushed are inside the snapshot: deliver them to the others first.
        self._flush()
        sub = _Subscriber()
        self._subscribers.add(sub)
        try:
            snapshot = [_assigned(a) for a in self.tracker.own()]
            yield inflight_pb2.InflightUpdate(
                replica_id=self.replica_id, sequence=1, snapshot=True, events=snapshot
            )
            sequence = 1
            while True:
                events = await sub.queue.get()
                if sub.overflowed:
                    return
                sequence += 1
                yield inflight_pb2.InflightUpdate(
                    replica_id=self.replica_id, sequence=sequence, events=events
                )
        finally:
            self._subscribers.discard(sub)

    # --- following peers -------------------------------------------------------------------

    async def _resolve_forever(self) -> None:
        while True:
            wanted: dict[str, str] = {}  # address -> the name it was resolved from
            for peer in self.peers:
                wanted |= dict.fromkeys(await _resolve(peer), peer.rpartition(":")[0].strip("[]"))
            for address in sorted(wanted.keys() - self._followers.keys() - self._skip):
                self._followers[address] = asyncio.create_task(
                    self._follow(address, wanted[address])
                )
            for address in list(self._followers.keys() - wanted):
                self._followers.pop(address).cancel()
            await asyncio.sleep(self._resolve_every_s)

    async def _follow(self, address: str, name: str) -> None:
        delay = _BACKOFF_S[0]
        # Over TLS the certificate names the peers' name (e.g. the headless Service), not the
        # address it resolved to.
        options = [("grpc.ssl_target_name_override", name)] if self._tls_ca else []
        request = inflight_pb2.SubscribeInflightRequest(replica_id=self.replica_id)
        metadata = grpc_util.token_metadata(self._token)
        while True:
            origin = ""
            try:
                async with grpc_util.aio_channel(address, self._tls_ca, options) as channel:
                    stub = inflight_pb2_grpc.InflightExchangeStub(channel)
                    async for update in stub.Subscribe(request, metadata=metadata):
                        if update.snapshot:
                            if any(
                                r == update.replica_id and a != address
                                for a, r in self.connected.items()
                            ):
                                # The same replica under another address (IPv4 and IPv6).
                                self._skip.add(address)
                                self._followers.pop(address, None)
                                return
                            if origin:
                                self.tracker.drop_peer(origin)
                            origin = update.replica_id
                            self.tracker.drop_peer(origin)
                            self.connected[address] = origin
                            log.info("following replica %s at %s", origin, address)
                        self._apply(origin, update)
                        delay = _BACKOFF_S[0]
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self._skip.add(address)  # that is this replica
                    self._followers.pop(address, None)
                    return
                log.debug("peer %s: %s: %s", address, exc.code().name, exc.details())
            finally:
                self.connected.pop(address, None)
                if origin:
                    dropped = self.tracker.drop_peer(origin)
                    log.info("replica %s at %s gone; dropped %d", origin, address, dropped)
            await asyncio.sleep(delay)
            delay = min(delay * 2, _BACKOFF_S[1])

    def _apply(self, origin: str, update: inflight_pb2.InflightUpdate) -> None:
        self._unseen.received(origin)
        for event in update.events:
            if event.kind == _RELEASED:
                self.tracker.release_peer(origin, event.request_id)
            elif event.kind == _ASSIGNED:
                self.tracker.add_peer(
                    origin,
                    event.request_id,
                    self.view.candidate(event.prefill_id) if event.prefill_id else None,
                    self.view.candidate(event.decode_id),
                    event.decode_blocks,
                    prefill_id=event.prefill_id,
                    decode_id=event.decode_id,
                    pending=not update.snapshot,
                    prefill_tokens=event.prefill_tokens,
                )


async def serve_exchange(
    exchange: InflightExchange,
    host: str,
    port: int,
    *,
    token: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> tuple[grpc.aio.Server, int]:
    """A gRPC server of its own for `exchange` (a gateway deciding itself has no other):
    the exchange plus health and reflection, `token` required on the exchange. Returns the
    started server and its bound port; stop it with `await server.stop(grace)`. Raises
    RuntimeError / OSError when the port cannot be bound."""
    interceptors = grpc_util.aio_server_interceptors(token)
    server = grpc.aio.server(interceptors=interceptors, options=grpc_util.SERVER_OPTIONS)
    inflight_pb2_grpc.add_InflightExchangeServicer_to_server(exchange.servicer, server)
    await grpc_util.aio_add_health_and_reflection(server, [SERVICE_NAME])
    bind = f"[{host}]" if ":" in host else host
    bound = grpc_util.add_port(server, f"{bind}:{port}", tls_cert, tls_key)
    await server.start()
    return server, bound


class EmbeddedExchange:
    """The exchange of a gateway deciding itself (`--scheduler embedded`): follows `peers` and,
    with `port` > 0, serves its own assignments on a gRPC server of its own at host:port.
    `await start()` inside the gateway's event loop, `await stop()` at shutdown."""

    def __init__(
        self,
        exchange: InflightExchange,
        host: str,
        port: int,
        *,
        token: str | None = None,
    ) -> None:
        self.exchange = exchange
        self._host = host
        self._port = port
        self._token = token
        self._server: grpc.aio.Server | None = None
        self.port = 0  # the bound port once started

    async def start(self) -> None:
        """Serves (with a port) and starts following; OSError/RuntimeError if it cannot bind."""
        if self._port:
            self._server, self.port = await serve_exchange(
                self.exchange, self._host, self._port, token=self._token
            )
        await self.exchange.start()

    async def stop(self) -> None:
        """Stops following and serving."""
        await self.exchange.stop()
        server, self._server = self._server, None
        if server is not None:
            await grpc_util.aio_stop(server, 0.5)


def _assigned(a: Assignment) -> inflight_pb2.InflightEvent:
    return inflight_pb2.InflightEvent(
        kind=_ASSIGNED,
        request_id=a.request_id,
        prefill_id=a.prefill_id,
        decode_id=a.decode_id,
        decode_blocks=a.decode_blocks,
        prefill_tokens=a.prefill_tokens,
    )


async def _resolve(peer: str) -> set[str]:
    """`host:port` -> every "address:port" the host resolves to (empty when it does not)."""
    host, sep, port = peer.rpartition(":")
    if not sep or not port.isdigit():
        log.warning("peer %r is not host:port; ignored", peer)
        return set()
    host = host.strip("[]")
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, int(port), type=socket.SOCK_STREAM
        )
    except OSError as exc:
        log.debug("peer %s does not resolve: %s", peer, exc)
        return set()
    out = set()
    for _family, _type, _proto, _name, sockaddr in infos:
        ip = str(sockaddr[0])
        out.add(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    return out
