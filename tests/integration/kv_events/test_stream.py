"""KvEvents.Subscribe over real gRPC servers on loopback (sync and asyncio)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from pdplane.core.grpc import util as grpc_util
from pdplane.core.kv_events.log import KvEventLog
from pdplane.core.kv_events.servicer import StreamOptions, add_kv_events_servicer
from pdplane.scheduler.kv_index.stream import KvStreamReader
from pdplane.v1 import kv_events_pb2, kv_events_pb2_grpc
from tests.support.kv_replica import Replica, log_state

TOKEN = "s3cret"


def _serve(log: KvEventLog, token: str | None = None, **opts: float) -> tuple[grpc.Server, str]:
    interceptors = [grpc_util.TokenAuthInterceptor(token)] if token else []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        interceptors=interceptors,
        options=grpc_util.SERVER_OPTIONS,
    )
    add_kv_events_servicer(server, log, StreamOptions(**opts))  # type: ignore[arg-type]
    port = grpc_util.add_port(server, "127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def log() -> KvEventLog:
    return KvEventLog(replay_blocks=64)


def _subscribe(
    address: str, reader: KvStreamReader, token: str | None = None
) -> Iterator[kv_events_pb2.KvEventsMessage]:
    stub = kv_events_pb2_grpc.KvEventsStub(grpc_util.channel(address))
    return stub.Subscribe(reader.request("test"), metadata=grpc_util.token_metadata(token))


def _store_many(log: KvEventLog, start: int, count: int, block_size: int = 16) -> None:
    for i in range(start, start + count):
        log.stored([i], None, [70_000 + (i + j) % 1000 for j in range(block_size)], block_size)


def _follow(
    stream: Iterator[kv_events_pb2.KvEventsMessage],
    reader: KvStreamReader,
    log: KvEventLog,
    timeout_s: float = 20.0,
) -> None:
    """Reads until the reader is exact as of the log's head."""
    deadline = time.monotonic() + timeout_s
    while not (reader.synced and reader.next_sequence == log.head + 1):
        assert time.monotonic() < deadline, "stream did not catch up"
        reader.feed(next(stream))


def test_snapshot_then_live_then_resume_without_snapshot(log: KvEventLog) -> None:
    _store_many(log, 0, 10)
    server, address = _serve(log)
    try:
        replica = Replica()
        reader = KvStreamReader(replica)
        stream = _subscribe(address, reader)
        _follow(stream, reader, log)
        assert replica.snapshots == 1 and replica.blocks == log_state(log)
        _store_many(log, 10, 5)
        log.removed([3, 4])
        _follow(stream, reader, log)
        assert replica.blocks == log_state(log)
        stream.cancel()  # type: ignore[attr-defined]
        _store_many(log, 15, 3)  # while disconnected, still in the ring
        stream = _subscribe(address, reader)
        _follow(stream, reader, log)
        assert replica.snapshots == 1  # resumed by replay
        assert replica.blocks == log_state(log)
        stream.cancel()  # type: ignore[attr-defined]
    finally:
        server.stop(None)


def test_gap_while_disconnected_gets_a_snapshot(log: KvEventLog) -> None:
    server, address = _serve(log)
    try:
        replica = Replica()
        reader = KvStreamReader(replica)
        stream = _subscribe(address, reader)
        _follow(stream, reader, log)
        stream.cancel()  # type: ignore[attr-defined]
        _store_many(log, 0, 200)  # 200 blocks > the 64 kept: cannot be replayed
        stream = _subscribe(address, reader)
        _follow(stream, reader, log)
        assert replica.snapshots == 2
        assert replica.blocks == log_state(log)
        stream.cancel()  # type: ignore[attr-defined]
    finally:
        server.stop(None)


def test_engine_restart_new_epoch_gets_a_snapshot() -> None:
    old = KvEventLog()
    _store_many(old, 0, 5)
    server, address = _serve(old)
    replica = Replica()
    reader = KvStreamReader(replica)
    stream = _subscribe(address, reader)
    _follow(stream, reader, old)
    stream.cancel()  # type: ignore[attr-defined]
    server.stop(None)
    new = KvEventLog()
    _store_many(new, 100, 2)
    server, address = _serve(new)
    try:
        stream = _subscribe(address, reader)
        _follow(stream, reader, new)
        assert reader.epoch == new.epoch and replica.snapshots == 2
        assert replica.blocks == log_state(new)
        stream.cancel()  # type: ignore[attr-defined]
    finally:
        server.stop(None)


def test_slow_subscriber_gets_a_fresh_snapshot_never_a_gap(log: KvEventLog) -> None:
    server, address = _serve(log)
    try:
        replica = Replica()
        reader = KvStreamReader(replica)
        stream = _subscribe(address, reader)
        _follow(stream, reader, log)
        # ~12 MB of events while the subscriber reads nothing: gRPC's flow control stops the
        # server's stream long before that, so its cursor falls out of the 64-block ring.
        _store_many(log, 0, 4000, block_size=1024)
        _follow(stream, reader, log, timeout_s=60)  # feed() raises StreamGap on any gap
        assert replica.snapshots >= 2
        assert replica.blocks == log_state(log)
        stream.cancel()  # type: ignore[attr-defined]
    finally:
        server.stop(None)


def test_token_is_required(log: KvEventLog) -> None:
    server, address = _serve(log, token=TOKEN)
    try:
        reader = KvStreamReader(Replica())
        with pytest.raises(grpc.RpcError) as err:
            next(_subscribe(address, reader))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            next(_subscribe(address, reader, token="wrong"))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stream = _subscribe(address, reader, token=TOKEN)
        _follow(stream, reader, log)
        assert reader.synced
        stream.cancel()  # type: ignore[attr-defined]
    finally:
        server.stop(None)


def test_heartbeats_on_an_idle_stream(log: KvEventLog) -> None:
    server, address = _serve(log, heartbeat_s=0.05)
    try:
        reader = KvStreamReader(Replica())
        stream = _subscribe(address, reader)
        _follow(stream, reader, log)
        kinds = [next(stream).WhichOneof("body") for _ in range(3)]
        assert kinds == ["heartbeat"] * 3
        stream.cancel()  # type: ignore[attr-defined]
    finally:
        server.stop(None)


def test_subscribers_are_bounded_and_slots_come_back(log: KvEventLog) -> None:
    server, address = _serve(log, max_subscribers=1)
    try:
        first = _subscribe(address, KvStreamReader(Replica()))
        next(first)
        with pytest.raises(grpc.RpcError) as err:
            next(_subscribe(address, KvStreamReader(Replica())))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        first.cancel()  # type: ignore[attr-defined]
        deadline = time.monotonic() + 5
        while True:  # the cancelled stream's slot is given back once its handler ends
            try:
                again = _subscribe(address, KvStreamReader(Replica()))
                next(again)
                again.cancel()  # type: ignore[attr-defined]
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        server.stop(None)


def test_closing_the_log_ends_streams_unavailable(log: KvEventLog) -> None:
    server, address = _serve(log)
    try:
        reader = KvStreamReader(Replica())
        stream = _subscribe(address, reader)
        _follow(stream, reader, log)
        threading.Timer(0.1, log.close).start()
        with pytest.raises(grpc.RpcError) as err:
            while True:
                next(stream)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)


async def test_asyncio_server_serves_the_same_stream() -> None:
    log = KvEventLog(replay_blocks=64)
    server = grpc.aio.server(
        interceptors=[grpc_util.AioTokenAuthInterceptor(TOKEN)], options=grpc_util.SERVER_OPTIONS
    )
    add_kv_events_servicer(server, log, StreamOptions(heartbeat_s=0.05))
    port = grpc_util.add_port(server, "127.0.0.1:0")
    await server.start()
    try:
        _store_many(log, 0, 10)
        replica = Replica()
        reader = KvStreamReader(replica)
        async with grpc_util.aio_channel(f"127.0.0.1:{port}") as channel:
            stub = kv_events_pb2_grpc.KvEventsStub(channel)
            denied = stub.Subscribe(reader.request())
            with pytest.raises(grpc.RpcError) as err:
                await denied.read()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            call = stub.Subscribe(reader.request(), metadata=grpc_util.token_metadata(TOKEN))

            async def follow() -> None:
                while not (reader.synced and reader.next_sequence == log.head + 1):
                    reader.feed(await asyncio.wait_for(call.read(), 5))

            await follow()
            # written from another thread, as the connector's reader thread does
            writer = threading.Thread(target=_store_many, args=(log, 10, 300))
            writer.start()
            await asyncio.to_thread(writer.join)
            await follow()
            assert replica.blocks == log_state(log)
            # Exact either way: the 300 blocks outran the 64 kept (a fresh snapshot) or the
            # stream's buffers held them (none); which one depends on the machine's timing.
            assert replica.snapshots >= 1
            msg = await asyncio.wait_for(call.read(), 5)
            assert msg.WhichOneof("body") == "heartbeat"
            call.cancel()
    finally:
        await server.stop(None)


def _events_of(msg: kv_events_pb2.KvEventsMessage) -> int:
    return len(msg.events.events) if msg.WhichOneof("body") == "events" else 0


def test_min_interval_batches_the_events_of_the_interval(log: KvEventLog) -> None:
    # The first event after a quiet interval goes at once; what comes within the next
    # min_interval_ms travels as one message (the subscriber's cost follows its rate).
    server, address = _serve(log, heartbeat_s=5.0)
    try:
        reader = KvStreamReader(Replica())
        stub = kv_events_pb2_grpc.KvEventsStub(grpc_util.channel(address))
        stream = stub.Subscribe(reader.request("test", min_interval_ms=1000))
        _store_many(log, 0, 1)
        _follow(stream, reader, log)  # the snapshot, then the first event's message
        _store_many(log, 1, 1)
        first = next(stream)
        sent = time.monotonic()
        assert _events_of(first) == 1
        _store_many(log, 2, 49)  # within the hold that `first` started
        second = next(stream)
        assert _events_of(second) == 49
        assert time.monotonic() - sent >= 0.8
        reader.feed(first)
        reader.feed(second)
        assert reader.next_sequence == log.head + 1
        stream.cancel()
    finally:
        server.stop(None)


async def test_asyncio_server_batches_with_min_interval() -> None:
    log = KvEventLog(replay_blocks=64)
    server = grpc.aio.server(options=grpc_util.SERVER_OPTIONS)
    add_kv_events_servicer(server, log, StreamOptions(heartbeat_s=5.0))
    port = grpc_util.add_port(server, "127.0.0.1:0")
    await server.start()
    try:
        reader = KvStreamReader(Replica())
        async with grpc_util.aio_channel(f"127.0.0.1:{port}") as channel:
            stub = kv_events_pb2_grpc.KvEventsStub(channel)
            call = stub.Subscribe(reader.request("test", min_interval_ms=1000))
            _store_many(log, 0, 1)
            while not (reader.synced and reader.next_sequence == log.head + 1):
                reader.feed(await asyncio.wait_for(call.read(), 5))
            _store_many(log, 1, 1)
            assert _events_of(await asyncio.wait_for(call.read(), 5)) == 1
            _store_many(log, 2, 49)
            assert _events_of(await asyncio.wait_for(call.read(), 5)) == 49
            call.cancel()
    finally:
        await server.stop(None)


def _store_chain(log: KvEventLog, start: int, count: int, block_size: int = 16) -> None:
    """Single-block stores, each the child of the one before (decode-time blocks)."""
    for i in range(start, start + count):
        parent = i - 1 if i > start else None
        log.stored([i], parent, [(i * 7 + j) % 1000 for j in range(block_size)], block_size)


def test_columnar_stores_reach_the_subscriber_that_asks_and_no_other(log: KvEventLog) -> None:
    """Chained single-block stores with a removal and a multi-block store among them: a
    reader (it asks for columnar stores) gets them as `stored_columns` and ends with the log's
    state; a request without the flag (an older subscriber) gets plain events only."""
    server, address = _serve(log)
    try:
        replica = Replica()
        reader = KvStreamReader(replica)
        stream = _subscribe(address, reader)
        _follow(stream, reader, log)  # the empty snapshot
        _store_chain(log, 100, 20)
        log.removed([105])
        log.stored([200, 201], 119, list(range(32)), 16)
        _store_chain(log, 300, 10)
        columnar = 0
        deadline = time.monotonic() + 20
        while reader.next_sequence != log.head + 1:
            assert time.monotonic() < deadline, "stream did not catch up"
            msg = next(stream)
            if msg.HasField("events"):
                columnar += msg.events.stored_columns.count
            reader.feed(msg)
        assert columnar == 19 + 9  # every chained store but each chain's first
        assert replica.blocks == log_state(log)
        stream.cancel()  # type: ignore[attr-defined]
        stub = kv_events_pb2_grpc.KvEventsStub(grpc_util.channel(address))
        old = kv_events_pb2.SubscribeKvEventsRequest(epoch=log.epoch, from_sequence=1)
        msg = next(stub.Subscribe(old))
        assert msg.HasField("events") and len(msg.events.events) == log.head
        assert not msg.events.HasField("stored_columns")
    finally:
        server.stop(None)
