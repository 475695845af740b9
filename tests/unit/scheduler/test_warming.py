"""Prefix warming: a prefix many requests read is copied onto an idle prefill that lacks it,
only then, one warm at a time, and the hint crosses the wire (`pdplane.scheduler.warming`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from pdplane.scheduler.decision import Decider
from pdplane.scheduler.inflight import InflightTracker
from pdplane.scheduler.kv_index import PrefixIndex
from pdplane.scheduler.metrics import SchedulerMetrics
from pdplane.scheduler.port import Decision, Outcome
from pdplane.scheduler.settings import PolicySettings
from pdplane.scheduler.view import CandidateView
from pdplane.scheduler.warming import WARM_RECHECK_S, PrefixWarmer, WarmSettings
from pdplane.scheduler.wire import decision_from_pb, decision_to_pb
from tests.unit.scheduler.helpers import BS, Clock, MakeInstance, hold, req, tokens

SHARED = 80 * BS  # 1,280 tokens: above the default --kv-warm-min-tokens (1,024)
RULE = WarmSettings(min_tokens=1024, window_s=10.0, requests_per_holder=4)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def fleet(fake_source: type, make_instance: MakeInstance, clock: Clock) -> Callable[..., Decider]:
    """3 prefill + 1 decode, kv_aware, warming by `RULE`; p0 holds `SHARED`'s prompt."""

    def make(
        loads: dict[str, dict[str, Any]] | None = None, policy: str = "kv_aware", **kwargs: Any
    ) -> Decider:
        loads = loads or {}
        instances = [
            make_instance(name, role, **loads.get(name, {}))
            for name, role in (("p0", "prefill"), ("p1", "prefill"), ("p2", "prefill"))
        ] + [make_instance("d0", "decode")]
        kwargs.setdefault("warm", RULE)
        service = Decider(
            CandidateView(fake_source(*instances)),
            prefill_policy=policy,
            decode_policy=policy,
            inflight=InflightTracker(clock=clock),
            **kwargs,
        )
        service.kv_index = PrefixIndex()
        hold(service.kv_index, "p0", tokens(0, SHARED))
        for other in ("p1", "p2", "d0"):
            hold(service.kv_index, other, [])
        return service

    return make


def _reads(service: Decider, count: int, clock: Clock, start: int = 0) -> list[Decision]:
    """`count` requests reading the shared prefix, 0.1 s apart, each released at once."""
    out = []
    for i in range(start, start + count):
        decision = service.schedule(req(i, tokens(0, SHARED) + tokens(1000 + i, 40)))
        service.release(f"r{i}", Outcome.SUCCESS)
        out.append(decision)
        clock.now += 0.1
    return out


def test_a_prefix_read_often_is_warmed_once_on_an_idle_prefill_without_it(
    fleet: Callable[..., Decider], clock: Clock
) -> None:
    metrics = SchedulerMetrics()
    service = fleet(metrics=metrics)
    decisions = _reads(service, 6, clock)
    assert all(d.prefill is not None and d.prefill.instance_id == "p0" for d in decisions)
    warms = [d.warm for d in decisions if d.warm is not None]
    # The 4th read makes 4 reads for 1 holder: one warm, on the first idle non-holder, with
    # the whole blocks of the shared prefix; the ones after wait while it is predicted to run.
    assert [d.warm is not None for d in decisions] == [False, False, False, True, False, False]
    assert warms[0].instance.instance_id == "p1" and warms[0].prefix_tokens == SHARED
    assert metrics.registry.get_sample_value("pdplane_scheduler_prefix_warms_total") == 1.0
    assert metrics.registry.get_sample_value("pdplane_scheduler_prefix_warm_tokens_total") == SHARED


def test_once_the_copy_is_held_more_reads_are_needed_for_the_next(
    fleet: Callable[..., Decider], clock: Clock
) -> None:
    service = fleet()
    _reads(service, 4, clock)  # warms p1
    assert service.kv_index is not None
    hold(service.kv_index, "p1", tokens(0, SHARED))  # its KV events say it holds the prefix
    clock.now += 5.0  # the warm is done
    # 2 holders: 8 reads in the window are wanted; 4 of the 10 s window's reads are there.
    later = _reads(service, 4, clock, start=4)
    assert [d.warm for d in later[:3]] == [None, None, None]
    assert later[3].warm is not None and later[3].warm.instance.instance_id == "p2"


def test_a_hot_prefix_without_an_idle_prefill_is_looked_at_again_only_after_the_recheck(
    fake_source: type, make_instance: MakeInstance, clock: Clock
) -> None:
    busy = {"num_running": 1}
    instances = [
        make_instance("p0", "prefill"),
        make_instance("p1", "prefill", **busy),
        make_instance("d0", "decode"),
    ]
    source = fake_source(*instances)
    service = Decider(
        CandidateView(source),
        prefill_policy="kv_aware",
        decode_policy="kv_aware",
        inflight=InflightTracker(clock=clock),
        warm=RULE,
    )
    service.kv_index = PrefixIndex()
    hold(service.kv_index, "p0", tokens(0, SHARED))
    for other in ("p1", "d0"):
        hold(service.kv_index, other, [])
    assert all(d.warm is None for d in _reads(service, 4, clock))  # hot, p1 busy
    source.put(make_instance("p1", "prefill"))  # p1 has nothing to do now
    clock.now -= 0.1 - WARM_RECHECK_S / 2  # half the recheck after the 4th read's look
    soon = _reads(service, 1, clock, start=4)[0]
    assert soon.warm is None
    clock.now += WARM_RECHECK_S
    later = _reads(service, 1, clock, start=5)[0]
    assert later.warm is not None and later.warm.instance.instance_id == "p1"


def test_no_warm_without_enough_reads_or_after_they_age_out(
    fleet: Callable[..., Decider], clock: Clock
) -> None:
    service = fleet()
    for i in range(8):  # 8 reads, each 4 s apart: never 4 within 10 s
        decision = _reads(service, 1, clock, start=i)[0]
        assert decision.warm is None
        clock.now += 3.9


def test_no_warm_onto_a_busy_prefill_or_of_a_short_prefix(
    fleet: Callable[..., Decider], clock: Clock
) -> None:
    busy = {"num_running": 1}
    service = fleet(loads={"p1": busy, "p2": busy})
    assert all(d.warm is None for d in _reads(service, 8, clock))
    short = fleet(warm=WarmSettings(min_tokens=SHARED + BS, requests_per_holder=4))
    assert all(d.warm is None for d in _reads(short, 8, clock))


def test_warming_is_off_at_zero_min_tokens_and_under_a_load_only_policy(
    fleet: Callable[..., Decider], clock: Clock
) -> None:
    off = fleet(warm=WarmSettings(min_tokens=0))
    assert all(d.warm is None for d in _reads(off, 8, clock))
    load_only = fleet(policy="least_loaded")
    assert all(d.warm is None for d in _reads(load_only, 8, clock))


def test_the_warm_hint_crosses_the_wire(fleet: Callable[..., Decider], clock: Clock) -> None:
    service = fleet()
    decision = _reads(service, 4, clock)[-1]
    assert decision.warm is not None
    back = decision_from_pb(decision_to_pb(decision))
    assert back.warm is not None
    assert back.warm.instance.instance_id == "p1"
    assert back.warm.instance.url == decision.warm.instance.url
    assert back.warm.prefix_tokens == SHARED
    plain = decision_from_pb(decision_to_pb(_reads(fleet(), 1, clock)[0]))
    assert plain.warm is None


def test_the_read_counts_stay_bounded_by_the_window() -> None:
    warmer = PrefixWarmer(WarmSettings(window_s=1.0))
    for i in range(10_000):
        warmer.read(i, i * 0.01)  # each prefix read once: all but the last second forgotten
    assert len(warmer) <= 2 * 100 + 2


def test_a_prefill_not_live_in_the_index_is_not_warmed(
    fleet: Callable[..., Decider], clock: Clock
) -> None:
    service = fleet()
    assert service.kv_index is not None
    hold(service.kv_index, "p1", [], live=False)  # its KV events stale: a copy would not show
    warms = [d.warm for d in _reads(service, 4, clock) if d.warm is not None]
    assert [w.instance.instance_id for w in warms] == ["p2"]


@pytest.mark.parametrize(
    "field",
    [
        {"kv_warm_min_tokens": -1},
        {"kv_warm_window_s": 0.0},
        {"kv_warm_window_s": float("inf")},  # reads would never age out
        {"kv_warm_requests_per_holder": 0},
    ],
)
def test_the_warming_flags_refuse_values_out_of_range(field: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        PolicySettings(**field)  # type: ignore[arg-type]
