"""`KvIndexManager`: subscribes to every instance's `KvEvents` and keeps the `PrefixIndex`.

Follows the scheduler's registry view (`InstanceSource`): an instance that appears is
subscribed at its registered `kv_endpoint` (the connector's or simulator's gRPC server, where
KvEvents sits next to KvTransfer); one that leaves is unsubscribed and forgotten. A stream that
fails is retried with exponential backoff (0.2 s doubling to 5 s; 30 s for an instance without
the service). Everything runs on one background thread with its own asyncio loop, which is the
index's only writer; `PrefixIndex.match` may be called from any thread.

Staleness (docs/kv_events.md): an instance is LIVE only while its stream is exact and current.
It turns STALE (log line, `pdplane_scheduler_kv_stale_instances`, its state in
`states()`) when the stream is down, when no message (events or the 1 s heartbeat) came for
`stale_after_s`, or when it lags more than `max_lag_events` behind the engine; it is LIVE again
once its stream is exact again (a snapshot, or a replay that continues its sequence) and current.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdplane.core.grpc import util as grpc_util
from pdplane.scheduler.kv_index.index import InstanceBlocks, KvState, PrefixIndex
from pdplane.scheduler.kv_index.stream import KvStreamReader, StreamGap
from pdplane.scheduler.port import InstanceSource
from pdplane.v1 import kv_events_pb2_grpc

__all__ = ["KvIndexManager", "KvInstanceStatus"]

log = logging.getLogger(__name__)

_BACKOFF_START_S = 0.2
_BACKOFF_MAX_S = 5.0
_NO_SERVICE_RETRY_S = 30.0
_SWEEP_S = 0.1


@dataclass(frozen=True)
class KvInstanceStatus:
    """One instance as the index sees it (for `pdplane ls`, metrics and tests)."""

    instance_id: str
    state: KvState
    reason: str
    blocks: int
    lag_events: int
    last_message_age_s: float
    snapshots: int


class _Follower:
    def __init__(self, inst: InstanceBlocks, endpoint: str) -> None:
        self.inst = inst
        self.endpoint = endpoint
        self.reader = KvStreamReader(inst)
        self.task: asyncio.Task[None] | None = None
        self.last_message = time.monotonic()
        self.connected = False
        self.events = 0


class KvIndexManager:
    """Keeps `index` in step with every instance of `source`.

    Args:
        source: the registry view (`InstanceWatcher` or `StaticSource`).
        index: the index to fill (default: a new one).
        token / tls_ca: credentials of the instances' gRPC servers (the connectors' `token`).
        stale_after_s: an instance with no message for this long is STALE (s; the streams
            heartbeat every 1 s).
        max_lag_events: an instance more than this many events behind its engine is STALE.
        subscriber: name sent to the instances (their log lines).
        events_interval_ms: asks each instance for at most one events message per this many ms
            (it batches the interval's events): the index's cost per second then follows this
            rate, not the request rate, for up to this much staleness (0 = every batch at once).
    """

    def __init__(
        self,
        source: InstanceSource,
        index: PrefixIndex | None = None,
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        stale_after_s: float = 3.0,
        max_lag_events: int = 10_000,
        subscriber: str = "scheduler",
        events_interval_ms: int = 10,
    ) -> None:
        self.source = source
        self.index = index or PrefixIndex()
        self._token = token
        self._tls_ca = tls_ca
        self.stale_after_s = stale_after_s
        self.max_lag_events = max_lag_events
        self._subscriber = subscriber
        self._events_interval_ms = events_interval_ms
        self._followers: dict[str, _Follower] = {}
        self._revision = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.stale_transitions = 0
        self.snapshots = 0
        self.stream_errors = 0
        self.on_state: Callable[[str, KvState, str], None] | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the background thread (returns at once)."""
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            ready.set()
            try:
                loop.run_until_complete(self._main())
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="pdplane-kv-index", daemon=True)
        self._thread.start()
        ready.wait()

    def stop(self) -> None:
        """Cancels every stream and stops the thread; idempotent."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def wait_live(self, timeout_s: float, instance_ids: set[str] | None = None) -> bool:
        """True once every instance of the view that has a KV endpoint (or of `instance_ids`)
        is LIVE; False after `timeout_s` seconds."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = {s.instance_id: s.state for s in self.states()}
            wanted = instance_ids if instance_ids is not None else self._endpoints().keys()
            if wanted and all(states.get(i) is KvState.LIVE for i in wanted):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    # -- reads ---------------------------------------------------------------------------------

    def states(self) -> list[KvInstanceStatus]:
        """Every subscribed instance's state, sorted by id."""
        now = time.monotonic()
        out = []
        for iid, f in sorted(list(self._followers.items())):
            out.append(
                KvInstanceStatus(
                    iid,
                    f.inst.state,
                    f.inst.state_reason,
                    f.inst.num_blocks,
                    f.reader.lag,
                    now - f.last_message,
                    f.reader.snapshots,
                )
            )
        return out

    def register_metrics(self, registry: CollectorRegistry) -> None:
        """Exposes the index's metrics (read at scrape time) on `registry`."""
        registry.register(_KvCollector(self))

    # -- the background loop -------------------------------------------------------------------

    def _endpoints(self) -> dict[str, str]:
        return {
            iid: inst.spec.kv_endpoint
            for iid, inst in self.source.snapshot().items()
            if inst.spec.kv_endpoint
        }

    async def _main(self) -> None:
        try:
            while not self._stopping.is_set():
                self._sync_instances()
                self._sweep()
                await asyncio.sleep(_SWEEP_S)
        finally:
            tasks = [f.task for f in self._followers.values() if f.task is not None]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _sync_instances(self) -> None:
        revision = self.source.revision
        if revision == self._revision:
            return
        self._revision = revision
        wanted = self._endpoints()
        for iid in list(self._followers):
            if wanted.get(iid) != self._followers[iid].endpoint:
                follower = self._followers.pop(iid)
                if follower.task is not None:
                    follower.task.cancel()
                self.index.remove_instance(iid)
                log.info("KV index: %s left; its blocks are forgotten", iid)
        for iid, endpoint in wanted.items():
            if iid not in self._followers:
                f = _Follower(self.index.add_instance(iid), endpoint)
                self._followers[iid] = f
                f.task = asyncio.get_running_loop().create_task(self._follow(f))

    def _sweep(self) -> None:
        now = time.monotonic()
        for f in self._followers.values():
            state = f.inst.state
            if not f.connected or not f.reader.synced:
                continue
            if now - f.last_message > self.stale_after_s:
                self._set(f, KvState.STALE, f"no message for {now - f.last_message:.1f} s")
            elif f.reader.lag > self.max_lag_events:
                self._set(f, KvState.STALE, f"{f.reader.lag} events behind")
            elif state is not KvState.LIVE:
                self._set(f, KvState.LIVE, "")

    def _set(self, f: _Follower, state: KvState, reason: str) -> None:
        inst = f.inst
        if inst.state is state:
            inst.state_reason = reason or inst.state_reason
            return
        self.index.set_state(inst, state, reason)
        if state is KvState.STALE:
            self.stale_transitions += 1
            log.warning(
                "KV index: %s is stale (%s): routing ignores its cache", inst.instance_id, reason
            )
        elif state is KvState.LIVE:
            log.info("KV index: %s is live (%d blocks)", inst.instance_id, inst.num_blocks)
        if self.on_state is not None:
            self.on_state(inst.instance_id, state, reason)

    async def _follow(self, f: _Follower) -> None:
        backoff = _BACKOFF_START_S
        metadata = grpc_util.token_metadata(self._token)
        while not self._stopping.is_set():
            delay = backoff
            try:
                async with grpc_util.aio_channel(f.endpoint, self._tls_ca) as channel:
                    stub = kv_events_pb2_grpc.KvEventsStub(channel)
                    call = stub.Subscribe(
                        f.reader.request(self._subscriber, self._events_interval_ms),
                        metadata=metadata,
                    )
                    async for msg in call:
                        if not f.connected:
                            f.connected = True
                            backoff = _BACKOFF_START_S
                        f.last_message = time.monotonic()
                        was = f.reader.snapshots
                        kind = msg.WhichOneof("body")
                        f.reader.feed(msg)
                        if kind == "events":
                            f.events += len(msg.events.events)
                        if f.reader.snapshots != was:
                            self.snapshots += 1
                        if (
                            f.reader.synced
                            and f.inst.state is not KvState.LIVE
                            and f.reader.lag <= self.max_lag_events
                        ):
                            self._set(f, KvState.LIVE, "")
                    reason = "stream ended"
            except asyncio.CancelledError:
                raise
            except StreamGap as exc:
                reason = f"stream gap: {exc}"
                delay = 0.0  # reconnect at once, asking for a snapshot
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                reason = f"stream down: {code.name if code else exc}"
                if code is grpc.StatusCode.UNIMPLEMENTED:
                    reason = "no KvEvents service"
                    delay = _NO_SERVICE_RETRY_S
            except Exception as exc:  # a bug in one stream must not end the others
                log.exception("KV index: stream of %s failed", f.inst.instance_id)
                reason = f"stream failed: {exc}"
            f.connected = False
            self.stream_errors += 1
            self._set(f, KvState.STALE if f.reader.snapshots else KvState.SYNCING, reason)
            if f.inst.state is KvState.SYNCING:
                f.inst.state_reason = reason
            await asyncio.sleep(delay)
            backoff = min(backoff * 2, _BACKOFF_MAX_S)


class _KvCollector(Collector):
    def __init__(self, manager: KvIndexManager) -> None:
        self._m = manager

    def collect(self) -> Iterator[Metric]:
        states = self._m.states()
        by_state = GaugeMetricFamily(
            "pdplane_scheduler_kv_instances",
            "Instances followed by the prefix index, by state (live, syncing, stale)",
            labels=["state"],
        )
        for st in KvState:
            by_state.add_metric([st.value], sum(1 for s in states if s.state is st))
        yield by_state
        stale = GaugeMetricFamily(
            "pdplane_scheduler_kv_stale_instances",
            "Instances whose KV events stream is down or lagging (their cache is not trusted)",
        )
        stale.add_metric([], sum(1 for s in states if s.state is not KvState.LIVE))
        yield stale
        entries = GaugeMetricFamily(
            "pdplane_scheduler_kv_index_blocks",
            "(instance, block) entries in the prefix index",
        )
        entries.add_metric([], self._m.index.entries)
        yield entries
        for name, doc, value in (
            ("snapshots", "Snapshots applied to the prefix index", self._m.snapshots),
            ("stream_errors", "KV events streams that failed or ended", self._m.stream_errors),
            ("stale_transitions", "Times an instance turned stale", self._m.stale_transitions),
        ):
            counter = CounterMetricFamily(f"pdplane_scheduler_kv_{name}", doc)
            counter.add_metric([], value)
            yield counter
