"""KvIndexManager over real KvEvents gRPC servers: subscribe, stale detection, restart."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest

from pdplane.core.grpc import util as grpc_util
from pdplane.core.kv_events.log import KvEventLog
from pdplane.core.kv_events.servicer import StreamOptions, add_kv_events_servicer
from pdplane.core.prefix_hash import block_hashes
from pdplane.scheduler.kv_index import KvIndexManager, KvState
from pdplane.scheduler.view import StaticSource
from pdplane.v1 import instance_pb2

BS = 16
TOKEN = "tok"


class Engine:
    """A KvEventLog on its own gRPC server, like a connector's or a simulator's."""

    def __init__(self, name: str, heartbeat_s: float = 0.2) -> None:
        self.name = name
        self.log = KvEventLog()
        self.heartbeat_s = heartbeat_s
        self.server: grpc.Server | None = None
        self.port = 0
        self.start()

    def start(self, port: int = 0) -> None:
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4),
            interceptors=[grpc_util.TokenAuthInterceptor(TOKEN)],
            options=grpc_util.SERVER_OPTIONS,
        )
        add_kv_events_servicer(server, self.log, StreamOptions(heartbeat_s=self.heartbeat_s))
        self.port = grpc_util.add_port(server, f"127.0.0.1:{port or self.port}")
        server.start()
        self.server = server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(None)
            self.server = None

    def instance(self) -> instance_pb2.Instance:
        return instance_pb2.Instance(
            spec=instance_pb2.InstanceSpec(
                instance_id=self.name, kv_endpoint=f"127.0.0.1:{self.port}", model="tiny"
            )
        )

    def store(self, tokens: list[int]) -> None:
        n = len(tokens) // BS
        hashes = [hash((self.name, tuple(tokens[: (i + 1) * BS]))) & (2**64 - 1) for i in range(n)]
        self.log.stored(hashes, None, tokens[: n * BS], BS)


def _tokens(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(blocks * BS)]


def _wait(cond: Callable[[], bool], timeout: float = 10.0) -> float:
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.01)
    return time.monotonic() - start


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made = [Engine("e0"), Engine("e1")]
    yield made
    for e in made:
        e.stop()


def _manager(source: StaticSource, **kw: float) -> KvIndexManager:
    m = KvIndexManager(source, token=TOKEN, **kw)  # type: ignore[arg-type]
    m.start()
    return m


def test_follows_every_instance_and_forgets_those_that_leave(engines: list[Engine]) -> None:
    prompt = _tokens(1, 4)
    engines[0].store(prompt)
    source = StaticSource(*(e.instance() for e in engines))
    m = _manager(source)
    try:
        assert m.wait_live(10)
        hashes = block_hashes(prompt, BS)
        assert m.index.match(hashes) == {"e0": 4}
        engines[1].store(prompt[: 2 * BS])  # live event
        _wait(lambda: m.index.match(hashes) == {"e0": 4, "e1": 2})
        source.remove("e0")
        _wait(lambda: m.index.match(hashes) == {"e1": 2})
        assert [s.instance_id for s in m.states()] == ["e1"]
    finally:
        m.stop()


def test_killed_stream_is_stale_within_the_bound_and_live_after_its_snapshot(
    engines: list[Engine],
) -> None:
    prompt = _tokens(2, 3)
    engines[0].store(prompt)
    source = StaticSource(engines[0].instance())
    m = _manager(source, stale_after_s=1.0)
    try:
        assert m.wait_live(10)
        hashes = block_hashes(prompt, BS)
        engines[0].stop()  # the instance's event stream dies
        took = _wait(lambda: m.states()[0].state is KvState.STALE, timeout=5)
        assert took <= 1.5  # stream down: noticed at once, well within stale_after_s
        assert m.index.match(hashes) == {}  # not trusted while stale
        assert "down" in m.states()[0].reason
        engines[0].start(engines[0].port)
        _wait(lambda: m.states()[0].state is KvState.LIVE)
        assert m.index.match(hashes) == {"e0": 3}
    finally:
        m.stop()


def test_silent_stream_is_stale_after_stale_after_s() -> None:
    quiet = Engine("quiet", heartbeat_s=60)  # the server stops talking (hung engine)
    try:
        m = _manager(StaticSource(quiet.instance()), stale_after_s=0.5)
        try:
            assert m.wait_live(10)
            took = _wait(lambda: m.states()[0].state is KvState.STALE, timeout=5)
            assert 0.4 <= took <= 1.5
            assert "no message" in m.states()[0].reason
            assert m.stale_transitions == 1
        finally:
            m.stop()
    finally:
        quiet.stop()


def test_restarted_scheduler_is_exact_from_snapshots(engines: list[Engine]) -> None:
    prompts = [_tokens(10 + i, 5) for i in range(4)]
    for i, p in enumerate(prompts):
        engines[i % 2].store(p)
    source = StaticSource(*(e.instance() for e in engines))
    first = _manager(source)
    assert first.wait_live(10)
    expected = [first.index.match(block_hashes(p, BS)) for p in prompts]
    first.stop()  # the scheduler dies; the engines change meanwhile
    first_block = engines[0].log.snapshot()[1][0][1]  # prompts[0]'s first block
    engines[0].log.removed([first_block])
    extra = _tokens(99, 2)
    engines[1].store(extra)
    second = _manager(source)
    try:
        assert second.wait_live(10)  # before it would route anything
        assert second.index.match(block_hashes(extra, BS)) == {"e1": 2}
        assert second.index.match(block_hashes(prompts[0], BS)) == {}
        for p, before in zip(prompts[1:], expected[1:], strict=True):
            assert second.index.match(block_hashes(p, BS)) == before
    finally:
        second.stop()


def test_wrong_token_never_goes_live(engines: list[Engine]) -> None:
    m = KvIndexManager(StaticSource(engines[0].instance()), token="wrong")
    m.start()
    try:
        assert not m.wait_live(1.0)
        state = m.states()[0]
        assert state.state is KvState.SYNCING and "UNAUTHENTICATED" in state.reason
    finally:
        m.stop()
