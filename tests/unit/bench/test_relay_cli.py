"""`bench/relay/relay.py`'s arguments: what a run cannot use is refused before anything starts
(argparse's exit 2 naming it), and a `+base` tree that is not a pdplane checkout is refused
rather than run as the installed code."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.relay import proxies, relay


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--proxies", "pdplane-embeded"], "unknown proxy 'pdplane-embeded'"),
        (["--proxies", "pdplane-embedded,vllm-routr"], "unknown proxy 'vllm-routr'"),
        (["--proxies", "pdplane+bse"], "unknown pdplane variant(s) ['bse']"),
        (["--proxies", "vllm-router+base"], "variants are for pdplane proxies only"),
        (["--topologies", "1p1d"], "'1p1d': one of 1P1D, 2P4D"),
        (["--knobs", "realstic"], "'realstic': one of zero, realistic"),
        (["--concurrency", "16,x"], "comma-separated integers"),
        (["--concurrency", "0"], "each at least 1"),
        (["--repeat", "0"], "0 is below 1"),
        (["--duration", "0"], "0 is below 0.1"),
    ],
)
def test_arguments_a_run_cannot_use_are_refused_before_it_starts(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        relay.main(argv)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


def test_every_documented_proxy_name_is_accepted() -> None:
    for name in (
        "direct",
        "pdplane",
        "pdplane-embedded+kv_aware+base",
        "pdplane-concurrent+tok",
        "python-floor",
        "python-floor-fastapi",
        "vllm-router",
        "xpyd-proxy",
    ):
        proxies.check_name(name)


def test_a_base_tree_without_pdplane_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PDPLANE_BENCH_BASE_TREE", str(tmp_path))
    with pytest.raises(RuntimeError, match="is not a pdplane checkout"):
        proxies._tree_env(frozenset({"base"}))
