"""KvIndexManager over real KvEvents gRPC servers: subscribe, stale detection, restart."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdplane.core.prefix_hash import block_hashes
from pdplane.scheduler.kv_index import KvIndexManager, KvState
from pdplane.scheduler.view import StaticSource
from tests.integration.kv_events.helpers import BS, TOKEN, Engine, tokens, waited


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
    prompt = tokens(1, 4)
    engines[0].store(prompt)
    source = StaticSource(*(e.instance() for e in engines))
    m = _manager(source)
    try:
        assert m.wait_live(10)
        hashes = block_hashes(prompt, BS)
        assert m.index.match(hashes) == {"e0": 4}
        engines[1].store(prompt[: 2 * BS])  # live event
        waited(lambda: m.index.match(hashes) == {"e0": 4, "e1": 2})
        source.remove("e0")
        waited(lambda: m.index.match(hashes) == {"e1": 2})
        assert [s.instance_id for s in m.states()] == ["e1"]
    finally:
        m.stop()


def test_killed_stream_is_stale_within_the_bound_and_live_after_its_snapshot(
    engines: list[Engine],
) -> None:
    prompt = tokens(2, 3)
    engines[0].store(prompt)
    source = StaticSource(engines[0].instance())
    m = _manager(source, stale_after_s=1.0)
    try:
        assert m.wait_live(10)
        hashes = block_hashes(prompt, BS)
        engines[0].stop()  # the instance's event stream dies
        took = waited(lambda: m.states()[0].state is KvState.STALE, timeout=5)
        assert took <= 1.5  # stream down: noticed at once, well within stale_after_s
        assert m.index.match(hashes) == {}  # not trusted while stale
        assert "down" in m.states()[0].reason
        engines[0].start(engines[0].port)
        waited(lambda: m.states()[0].state is KvState.LIVE)
        assert m.index.match(hashes) == {"e0": 3}
    finally:
        m.stop()


def test_silent_stream_is_stale_after_stale_after_s() -> None:
    quiet = Engine("quiet", heartbeat_s=60)  # the server stops talking (hung engine)
    try:
        m = _manager(StaticSource(quiet.instance()), stale_after_s=0.5)
        try:
            assert m.wait_live(10)
            took = waited(lambda: m.states()[0].state is KvState.STALE, timeout=5)
            assert 0.4 <= took <= 1.5
            assert "no message" in m.states()[0].reason
            assert m.stale_transitions == 1
        finally:
            m.stop()
    finally:
        quiet.stop()


def test_restarted_scheduler_is_exact_from_snapshots(engines: list[Engine]) -> None:
    prompts = [tokens(10 + i, 5) for i in range(4)]
    for i, p in enumerate(prompts):
        engines[i % 2].store(p)
    source = StaticSource(*(e.instance() for e in engines))
    first = _manager(source)
    assert first.wait_live(10)
    expected = [first.index.match(block_hashes(p, BS)) for p in prompts]
    first.stop()  # the scheduler dies; the engines change meanwhile
    first_block = engines[0].log.snapshot()[1][0][1]  # prompts[0]'s first block
    engines[0].log.removed([first_block])
    extra = tokens(99, 2)
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
