"""TrafficWindow: arrival rate, prompt and output lengths from instance counters, and the
demand the gateway held back (`gateway_demand`)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from pdplane.autoscale.observe import GATEWAY, InstanceSample, TrafficWindow
from pdplane.autoscale.scrape import gateway_demand
from pdplane.gateway.metrics import GatewayMetrics


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


def test_an_instance_restarted_under_the_same_id_counts_from_its_restart() -> None:
    # p2 restarts between 3 s and 6 s under the same id: its counters begin again at zero
    # (as a Prometheus counter reset). Both prefills finish 4 req/s of 1000-token prompts:
    # 48 requests in 6 s, not a negative count clamped to no traffic.
    w = TrafficWindow(60.0)
    w.add(0.0, {"p1": _p(100, 100_000), "p2": _p(200, 200_000)})
    w.add(3.0, {"p1": _p(112, 112_000), "p2": _p(212, 212_000)})
    w.add(6.0, {"p1": _p(124, 124_000), "p2": _p(12, 12_000)})
    t = w.traffic()
    assert t.rate == pytest.approx(8.0)
    assert t.isl == pytest.approx(1000.0)


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


def _gw(left: float, waiting: float) -> InstanceSample:
    return InstanceSample("gateway", left, 0.0, 0.0, waiting=waiting)


def test_demand_held_back_at_the_gateway_counts_as_arrivals() -> None:
    # An overload: the prefill's queue stays at its in-flight budget (40 waiting) while the
    # gateway's flow control holds 30 more and shed 20 within the 10 s.
    w = TrafficWindow(60.0)
    w.add(0.0, {"p": _p(100, 100_000, waiting=40), GATEWAY: _gw(5, 0)})
    w.add(10.0, {"p": _p(150, 150_000, waiting=40), GATEWAY: _gw(25, 30)})
    t = w.traffic()
    assert t.rate == pytest.approx((50 + 30 + 20) / 10)
    assert t.isl == pytest.approx(1000.0)  # prompts are measured on what the prefill got
    obs = w.observation(float("nan"), float("nan"))
    assert obs.queued == 40 + 30  # those at the gateway wait for a prefill too
    assert set(obs.loads) <= {"prefill", "decode"}
    assert obs.loads["prefill"].waiting == pytest.approx(40.0)  # the instances' own load


def test_gateway_demand_reads_the_gateways_page_for_one_model() -> None:
    m = GatewayMetrics()
    m.flow_queued.labels("m1", "default", "0").set(3)
    m.flow_queued.labels("m1", "gold", "1").set(2)
    m.flow_queued.labels("m2", "default", "0").set(100)
    m.flow_shed.labels("m1", "default", "0", "overload").inc(7)
    m.flow_shed.labels("m1", "default", "0", "queue_full").inc(1)
    m.flow_timeouts.labels("m1", "default", "0").inc(2)
    m.flow_shed.labels("m1", "default", "0", "timeout").inc(1)  # one of those 2, answered 429
    m.flow_shed.labels("m2", "default", "0", "overload").inc(50)
    page = generate_latest(m.registry).decode()
    one = gateway_demand(page, "m1")
    assert (one.role, one.waiting, one.finished) == ("gateway", 5.0, 10.0)
    every = gateway_demand(page, None)
    assert (every.waiting, every.finished) == (105.0, 60.0)
    assert gateway_demand(page, "m3").waiting == 0.0
