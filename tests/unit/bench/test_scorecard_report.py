"""The scorecard's report compares kv_aware only with runs of its own kind: the same first-token
mode, and a kv_aware ablation (`--kv`) in a row of its own, whatever one file holds."""

from __future__ import annotations

from typing import Any

from bench.routing.scorecard import report, verdicts

METRICS = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p99_ms")


def _line(router: str, ttft: float, first_token: str | None, kv: str = "") -> dict[str, Any]:
    point: dict[str, Any] = {
        "topology": "4P4D",
        "workload": "cold",
        "load": 0.6,
        "router": router,
        "seed": 0,
        "kv": kv,
    }
    if first_token is not None:  # files written before the flag have no such field
        point["first_token"] = first_token
    return {
        "point": point,
        **{m: ttft for m in METRICS},
        "fleet_hit": 0.5,
        "prefill_legs_per_request": 1.0,
    }


def _grid(first_token: str | None, kv_ttft: float, base_ttft: float) -> list[dict[str, Any]]:
    return [
        _line("kv_aware", kv_ttft, first_token),
        *(_line(r, base_ttft, first_token) for r in ("least_loaded", "power_of_two")),
        _line("round_robin", base_ttft, first_token),
        _line("oracle", kv_ttft, first_token),
    ]


def test_the_two_first_token_modes_are_never_compared_with_each_other() -> None:
    # Prefill mode: kv_aware 8 ms against 8 ms; decode mode (an older file): 38 against 40.
    mixed = _grid("prefill", 8.0, 8.0) + _grid(None, 38.0, 40.0)
    rows = verdicts(mixed)
    assert sorted((r["first_token"], round(r["cells"]["ttft_p50_ms"][2], 2)) for r in rows) == [
        ("decode", 0.95),
        ("prefill", 1.0),
    ]
    text = report(mixed)
    assert "first token from decode" in text and "first token from prefill" in text


def test_a_kv_aware_ablation_gets_a_row_of_its_own() -> None:
    lines = [*_grid("prefill", 8.0, 8.0), _line("kv_aware", 16.0, "prefill", "warm_min_tokens=0")]
    rows = verdicts(lines)
    by_variant = {r["kv"]: r["cells"]["ttft_p50_ms"][2] for r in rows}
    assert by_variant == {"": 1.0, "warm_min_tokens=0": 2.0}
    assert "cold [kv warm_min_tokens=0]" in report(lines)
