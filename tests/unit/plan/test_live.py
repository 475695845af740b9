"""The live advice rules, the window's means, and the helpers' parsing."""

from __future__ import annotations

import math

import pytest

from pdplane.plan.live import LoadWindow, RoleLoad, advise, histogram_quantile
from pdplane.plan.live_cli import parse_duration
from pdplane.v1 import instance_pb2


def _inst(role: str, running: int, waiting: int, kv: float) -> instance_pb2.Instance:
    return instance_pb2.Instance(
        spec=instance_pb2.InstanceSpec(role=instance_pb2.Role.Value(f"ROLE_{role.upper()}")),
        load=instance_pb2.LoadReport(num_running=running, num_waiting=waiting, kv_cache_usage=kv),
    )


def test_window_means_per_instance_and_forgets_old_samples() -> None:
    w = LoadWindow(window_s=10)
    w.add([_inst("prefill", 0, 8, 0.1), _inst("decode", 4, 0, 0.5)], now=0)
    w.add([_inst("prefill", 0, 4, 0.1), _inst("decode", 4, 0, 0.7)], now=5)
    loads = w.loads()
    assert loads["prefill"].waiting == 6 and loads["decode"].kv_usage == pytest.approx(0.6)
    w.add([_inst("prefill", 0, 0, 0.1), _inst("decode", 4, 0, 0.7)], now=20)
    assert len(w.samples) == 1 and w.loads()["prefill"].waiting == 0
    w.add([_inst("both", 2, 3, 0.4)], now=21)
    assert w.loads()["decode"].instances == 1.0


def test_rules() -> None:
    idle, busy = RoleLoad(2, 0.1, 0.0, 0.1), RoleLoad(1, 4, 0, 0.5)
    assert advise({"prefill": RoleLoad(1, 1, 5, 0.1), "decode": busy}).summary == (
        "prefill-bound, add prefill"
    )
    assert advise({"prefill": busy, "decode": RoleLoad(1, 4, 0, 0.95)}).summary == (
        "decode-bound, add decode"
    )
    # ITL over target: decode, whatever the queues say
    a = advise({"prefill": busy, "decode": busy}, itl_p90_s=0.08, itl_slo_s=0.05)
    assert a.bottleneck == "decode"
    # TTFT over target with ITL fine: prefill
    a = advise(
        {"prefill": busy, "decode": busy},
        ttft_p90_s=3,
        ttft_slo_s=2,
        itl_p90_s=0.01,
        itl_slo_s=0.05,
    )
    assert a.bottleneck == "prefill"
    a = advise({"prefill": idle, "decode": busy})
    assert a.summary == "balanced, remove prefill" and a.delta == {"prefill": -1, "decode": 0}


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    b = [(0.1, 0.0), (0.2, 50.0), (0.4, 100.0), (math.inf, 100.0)]
    assert histogram_quantile(b, 0.5) == pytest.approx(0.2)
    assert histogram_quantile(b, 0.75) == pytest.approx(0.3)
    assert math.isnan(histogram_quantile([(math.inf, 0.0)], 0.9))


def test_parse_duration() -> None:
    assert parse_duration("10m") == 600 and parse_duration("250ms") == 0.25
    assert parse_duration("1.5s") == 1.5 and parse_duration("2") == 2
    with pytest.raises(ValueError):
        parse_duration("ten minutes")
