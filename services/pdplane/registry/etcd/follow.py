"""Keeps a replica's `EtcdView` following etcd: one watch on the whole prefix, from the
revision the view applied, re-opened on the next endpoint when it breaks; a reload when etcd
compacted past it; and periodic compaction of the history the load batches leave behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aetcd import rpc

from pdplane.registry.etcd.client import REQUIRE_LEADER, EtcdClient, prefix_end
from pdplane.registry.etcd.lease import FailureStreak, describe
from pdplane.registry.etcd.view import EtcdView
from pdplane.registry.store import StoreError

__all__ = ["ViewFollower"]

log = logging.getLogger(__name__)


class ViewFollower:
    """Feeds `view` with the etcd KVs under `prefix`; use on the store's event loop."""

    def __init__(self, client: EtcdClient, view: EtcdView, prefix: bytes) -> None:
        self._client = client
        self._view = view
        self._prefix = prefix
        self._progress = asyncio.Event()
        self.cluster_rev = 0  # the highest etcd revision any reply reported
        self.last_error = ""

    async def reload(self) -> None:
        """Reads every key under the prefix into the view (a fresh SNAPSHOT for watchers)."""
        reply = await self._client.call(
            "kv", "Range", rpc.RangeRequest(key=self._prefix, range_end=prefix_end(self._prefix))
        )
        self._view.load(reply.kvs, reply.header.revision)
        self.saw(reply.header.revision)

    def saw(self, etcd_rev: int) -> None:
        self.cluster_rev = max(self.cluster_rev, etcd_rev)

    async def reached(self, etcd_rev: int, timeout_s: float) -> bool:
        """Waits until the view applied `etcd_rev` (read-your-writes on this replica)."""
        deadline = time.monotonic() + timeout_s
        while self._view.applied < etcd_rev:
            event = self._progress
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), left)
        return True

    def _on_progress(self) -> None:
        done, self._progress = self._progress, asyncio.Event()
        done.set()

    async def follow(self) -> None:
        """The watch loop (a task, runs until cancelled)."""
        streak = FailureStreak(log, "etcd watch")
        while True:
            call = self._client.watch().Watch(metadata=REQUIRE_LEADER)
            try:
                create = rpc.WatchCreateRequest(
                    key=self._prefix,
                    range_end=prefix_end(self._prefix),
                    start_revision=self._view.applied + 1,
                    progress_notify=True,
                )
                await call.write(rpc.WatchRequest(create_request=create))
                async for reply in call:
                    streak.ok()
                    self.saw(reply.header.revision)
                    if reply.compact_revision:
                        log.warning("etcd compacted past this view; reloading")
                        await self.reload()
                        break
                    if reply.canceled:
                        raise StoreError(f"etcd cancelled the watch: {reply.cancel_reason}")
                    if reply.events:
                        self._view.apply(reply.events)
                    elif not reply.created:
                        self._view.advance(reply.header.revision)  # progress notification
                    self._on_progress()
            except Exception as exc:  # any failure: next endpoint, the task must live on
                self.last_error = f"watch via {self._client.endpoint}: {describe(exc)}"
                streak.failed(self.last_error)
                self._client.rotate()
                await asyncio.sleep(0.1)
            finally:
                call.cancel()

    async def compact(self, interval_s: float) -> None:
        """Compacts etcd's history to the revision seen one interval ago (a task): load batches
        rewrite one key per replica several times a second, and etcd keeps every old value
        until compacted. Any replica may do it; a compaction already done is an error to
        ignore. `interval_s` <= 0: never."""
        mark = 0
        while interval_s > 0:
            await asyncio.sleep(interval_s)
            if mark:
                with contextlib.suppress(StoreError):
                    await self._client.call("kv", "Compact", rpc.CompactionRequest(revision=mark))
            mark = self._view.applied
