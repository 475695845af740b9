"""bench/routing/scorecard.py refuses bad arguments at once, in one line, before running any
point (a bad `--kv` knob had run every other router of the grid, then nothing of kv_aware)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.routing.scorecard import kv_options, main, read_results
from pdplane.scheduler.warming import WarmSettings


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv", "bogus=1"], "unknown knob 'bogus'"),
        (["--kv", "warm_min_tokens=abc"], "is not a number"),
        (["--kv", "itl_weight"], "is not NAME=VALUE"),
        (["--workloads", "bogus"], "--workloads: unknown 'bogus'"),
        (["--topologies", "9P9D"], "--topologies: unknown '9P9D'"),
        (["--loads", "-1"], "--loads must be > 0"),
        (["--seeds", "x"], "--seeds integers"),
        (["--jobs", "0"], "--jobs must be >= 1"),
        (["--served", "--time-scale", "nan"], "--time-scale must be > 0"),
    ],
)
def test_bad_arguments_stop_before_any_point(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.jsonl"
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(out)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_kv_knobs_become_decider_options() -> None:
    got = kv_options("itl_weight=4,local_prefill_max_tokens=512,warm_min_tokens=0")
    assert got["local_prefill_max_tokens"] == 512
    assert got["kv_weights"].itl_weight == 4.0
    assert isinstance(got["warm"], WarmSettings) and got["warm"].min_tokens == 0
    assert kv_options("") == {}


def test_a_report_of_a_file_that_is_not_results_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"point": {}}\ngarbage\n')
    with pytest.raises(ValueError, match="line 2: not a result line"):
        read_results(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no results"):
        read_results(empty)
    with pytest.raises(ValueError, match="cannot read it"):
        read_results(tmp_path / "missing.jsonl")
