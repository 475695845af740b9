"""TrafficWindow: arrival rate, prompt and output lengths from instance counters."""

from __future__ import annotations

import pytest

from pdplane.autoscale.observe import InstanceSample, TrafficWindow


def _p(finished: float, prompt: float, waiting: float = 0.0) -> InstanceSample:
    return InstanceSample("prefill", finished, prompt, 0.0, 0.0, waiting)


def _d(finished: float, generated: float, running: float = 0.0) -> InstanceSample:
    return InstanceSample("decode", finished, 0.0, generated, running)


def test_rate_counts_completions_and_queue_growth_lengths_are_per_request() -> None:
    w = TrafficWindow(60.0)
    w.add(0.0, {"p": _p(100, 100_000), "d": _d(90, 27_000)})
    # 10 s later: 50 prefills done and 10 more queued = 60 arrivals; 1000 tokens each.
    w.add(10.0, {"p": _p(150, 160_000, waiting=10), "d": _d(140, 42_000)})
    t = w.traffic()
    assert t.rate == pytest.approx(6.0)
    assert t.isl == pytest.approx(1000.0)
    assert t.osl == pytest.approx(300.0)


def test_an_instance_counts_from_its_first_sample_in_the_window() -> None:
    w = TrafficWindow(60.0)
    w.add(0.0, {"p": _p(0, 0)})
    w.add(10.0, {"p": _p(20, 20_000), "p2": _p(500, 500_000)})  # p2: first seen here
    w.add(20.0, {"p": _p(40, 40_000), "p2": _p(520, 520_000)})
    assert w.traffic().rate == pytest.approx((40 + 20) / 20)


def test_old_samples_leave_the_window_and_the_last_part_can_be_read_alone() -> None:
    w = TrafficWindow(30.0)
    for k in range(7):  # 1 req/s for 30 s, then 5 req/s
        done = 10 * min(k, 3) + 50 * max(0, k - 3)
        w.add(10.0 * k, {"p": _p(done, 100 * done)})
    assert w.span_s == pytest.approx(30.0)
    assert w.traffic().rate == pytest.approx(5.0)
    w2 = TrafficWindow(60.0)
    for k in range(7):
        done = 10 * min(k, 3) + 50 * max(0, k - 3)
        w2.add(10.0 * k, {"p": _p(done, 100 * done)})
    assert w2.traffic().rate == pytest.approx(180 / 60)
    assert w2.traffic(last_s=10.0).rate == pytest.approx(5.0)


def test_no_traffic_before_two_samples() -> None:
    w = TrafficWindow(60.0)
    assert not w.traffic().known
    w.add(0.0, {"p": _p(1, 10)})
    assert not w.traffic().known
