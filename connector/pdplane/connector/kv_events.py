"""Reads vLLM's own KV cache events inside the instance and feeds the engine's `KvEventLog`.

vLLM's KV cache manager publishes `BlockStored` / `BlockRemoved` / `AllBlocksCleared` when
`--kv-events-config` enables them, through its ZMQ publisher (the only publisher vLLM 0.26 ..
0.33 accepts besides "null"). pdplane points it at a private endpoint (`ipc://` in a directory
only this instance's user can open) and this module is its only reader: a ZMQ SUB socket on
that endpoint, decoded with vLLM's own typed decoder (`msgspec.msgpack.Decoder(type=
KVEventBatch)` from `vllm.distributed.kv_events`, so each vLLM version decodes its own wire
form). That msgpack never leaves the instance: everything beyond this module is the typed
protobuf stream `pdplane.v1.KvEvents` (`pdplane.core.kv_events.log`). It is the only module of
the project allowed to import zmq and msgspec (`tests/unit/rules/test_project_rules.py`).

vLLM numbers its batches 0, 1, 2, ... A batch lost on the way (the publisher's high-water
mark, a reader that started late) is a gap: the reader cannot know what it said, so it clears
the log (`AllBlocksCleared`) and logs a warning. The index then under-predicts (blocks cached
before the gap are forgotten until stored again) but never claims a block the engine may have
evicted.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import msgspec
import zmq

from pdplane.core.kv_events.log import KvEventLog, canonical_extra_keys

__all__ = ["KvEventsReader", "reader_endpoint"]

log = logging.getLogger(__name__)

_POLL_MS = 200


def reader_endpoint(kv_events_config: Any, data_parallel_rank: int = 0) -> str | None:
    """The ZMQ endpoint this instance's reader connects to, or None when vLLM's events are off
    or cannot be read locally (a publisher that connects out instead of binding).

    `ipc://` and `inproc://` endpoints are used as they are; `tcp://*:P` / `tcp://0.0.0.0:P`
    binds are read at `tcp://127.0.0.1:P`. DP rank r > 0 gets vLLM's own offset."""
    if kv_events_config is None or not getattr(kv_events_config, "enable_kv_cache_events", False):
        return None
    if getattr(kv_events_config, "publisher", "zmq") != "zmq":
        return None
    endpoint = str(getattr(kv_events_config, "endpoint", "") or "")
    if data_parallel_rank:
        from vllm.distributed.kv_events import ZmqEventPublisher

        offset = ZmqEventPublisher.offset_endpoint_port(endpoint, data_parallel_rank)
        endpoint = offset or endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        if host in ("*", "0.0.0.0", "127.0.0.1", "localhost"):
            return f"tcp://127.0.0.1:{port}"
        if host in ("[::]", "::", "[::1]"):
            return f"tcp://[::1]:{port}"
    log.warning("KV events: cannot read vLLM's publisher at %s (not a local bind)", endpoint)
    return None


class KvEventsReader:
    """A daemon thread: vLLM's ZMQ KV events at `endpoint` -> `event_log`.

    Args:
        endpoint: where vLLM's publisher binds (see `reader_endpoint`).
        event_log: the engine's log (served by `pdplane.v1.KvEvents`).
        topic: vLLM's `kv_events_config.topic` ("" = all).
    """

    def __init__(self, endpoint: str, event_log: KvEventLog, topic: str = "") -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self.endpoint = endpoint
        self.log = event_log
        self._topic = topic.encode()
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._stop = threading.Event()
        self._next_seq: int | None = None
        self.batches = 0
        self.gaps = 0
        self.rejected = 0
        self._thread = threading.Thread(target=self._run, name="pdplane-kv-events", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("KV events: reading vLLM's publisher at %s", self.endpoint)

    def stop(self) -> None:
        """Stops the thread (within ~0.2 s) and closes the log; idempotent."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        self.log.close()

    def _run(self) -> None:
        ctx: Any = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.SUBSCRIBE, self._topic)
            sock.setsockopt(zmq.RCVHWM, 0)  # never drop on our side: the engine's hwm bounds it
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoint)
            while not self._stop.is_set():
                if not sock.poll(_POLL_MS):
                    continue
                frames = sock.recv_multipart()
                try:
                    self.handle(frames)
                except Exception:  # one bad batch must not end the reader
                    self.rejected += 1
                    log.exception("KV events: batch dropped")
        finally:
            sock.close(linger=0)

    def handle(self, frames: list[bytes]) -> None:
        """One published message: (topic, 8-byte big-endian sequence, msgpack batch)."""
        if len(frames) < 3:
            self.rejected += 1
            return
        seq = int.from_bytes(frames[-2], "big", signed=True)
        if self._next_seq is not None and seq != self._next_seq:
            self._gap(f"expected batch {self._next_seq}, got {seq}")
        elif self._next_seq is None and seq != 0:
            self._gap(f"first batch seen is {seq}")
        self._next_seq = seq + 1
        batch = self._decoder.decode(frames[-1])
        self.batches += 1
        for event in batch.events:
            self._apply(event)

    def _gap(self, why: str) -> None:
        self.gaps += 1
        if self.log.num_blocks:
            log.warning(
                "KV events: %s; clearing the cached set (exact again as blocks are stored)", why
            )
            self.log.cleared()

    def _apply(self, event: Any) -> None:
        kind = type(event).__name__
        if kind == "BlockStored":
            extra = getattr(event, "extra_keys", None)
            try:
                self.log.stored(
                    event.block_hashes,
                    event.parent_block_hash,
                    event.token_ids,
                    event.block_size,
                    medium=getattr(event, "medium", None),
                    lora_id=getattr(event, "lora_id", None),
                    lora_name=getattr(event, "lora_name", None),
                    extra_keys=[canonical_extra_keys(k) for k in extra] if extra else None,
                )
            except ValueError as exc:
                self.rejected += 1
                log.debug("KV events: BlockStored not logged: %s", exc)
        elif kind == "BlockRemoved":
            self.log.removed(event.block_hashes, medium=getattr(event, "medium", None))
        elif kind == "AllBlocksCleared":
            self.log.cleared()
        else:
            self.rejected += 1
