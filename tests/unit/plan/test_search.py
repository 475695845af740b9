"""The P:D search, the SLO grammar, workloads and the `pdplane plan` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdplane.cli.main import main as pdplane_main
from pdplane.plan.search import parse_slo, plan_fleet
from pdplane.plan.workload import SHAPES, load_workload
from pdplane.sim.profiles import PROFILES


def test_parse_slo() -> None:
    slo = parse_slo("ttft_p90<=2s, itl_p99<=50ms")
    assert slo.targets == (("ttft", 0.9, 2.0), ("itl", 0.99, 0.05))
    assert slo.bound("itl") == 0.05
    for bad in ("ttft<=2s", "itl_p90<50ms", "tpot_p90<=1s", ""):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_plan_meets_the_slo_and_each_neighbour_breaks_it() -> None:
    prof = PROFILES["llama3-8b-h100"]
    reqs = load_workload("poisson:isl=3000,osl=300,rate=12")
    assert not isinstance(reqs, list)
    slo = parse_slo("ttft_p90<=1s,itl_p90<=30ms")
    plan = plan_fleet(prof, reqs.requests(40.0), slo, warmup_s=10.0, gpus=16)
    assert plan.best is not None
    assert slo.met(plan.best)
    assert plan.neighbours and all(not slo.met(n) for n in plan.neighbours)
    assert (
        plan.plain_same is not None and plan.plain_same.config.plain == plan.best.config.instances
    )


def test_plan_says_when_the_gpus_are_not_enough() -> None:
    prof = PROFILES["llama3-8b-h100"]
    reqs = SHAPES["seed-long-output"].requests(30.0, rate=20.0)
    plan = plan_fleet(prof, reqs, parse_slo("ttft_p90<=2s,itl_p90<=50ms"), warmup_s=10, gpus=2)
    assert plan.best is None and "cannot be met with 2 GPUs" in plan.reason


def test_trace_workload(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text(
        '{"at": 5, "prompt_tokens": 10, "output_tokens": 3}\n{"at": 6, "prompt": "a b c"}\n'
    )
    reqs = load_workload(str(f))
    assert isinstance(reqs, list)
    assert [(r.at, r.prompt_tokens, r.output_tokens) for r in reqs] == [(0, 10, 3), (1, 3, 128)]
    f.write_text('{"at": 1}\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:1"):
        load_workload(str(f))
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("nope")


def test_cli_prints_a_recommendation(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--workload", "poisson:isl=1000,osl=100,rate=5", "--duration-s", "20"]
    assert pdplane_main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommended"]["meets_slo"] and out["fleets_simulated"] >= 2
    assert pdplane_main(argv) == 0
    assert "recommendation:" in capsys.readouterr().out


def test_cli_bad_input_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert pdplane_main(["plan", "--slo", "ttft<2"]) == 2
    assert "bad SLO term" in capsys.readouterr().err
    assert pdplane_main(["plan", "--profile", "nope"]) == 2


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("rate", "-4"),
        ("rate", "0"),
        ("rate", "inf"),
        ("rate", "nan"),
        ("isl", "0"),
        ("isl", "1.5"),
        ("osl", "-5"),
        ("cv", "0"),
    ],
)
def test_a_poisson_workload_field_out_of_range_is_one_line_and_exit_2(
    field: str, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = f"poisson:{field}={bad}"
    assert pdplane_main(["plan", "--workload", spec, "--duration-s", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{field} must be" in err and repr(bad) in err


@pytest.mark.parametrize("flag", ["--rate", "--duration-s"])
def test_an_infinite_rate_or_duration_is_refused(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        pdplane_main(["plan", "--workload", "poisson:rate=4", flag, "inf"])
    assert exited.value.code == 2 and "finite" in capsys.readouterr().err
