"""`pdplane up` refuses the controller's flags without --autoscale instead of ignoring them."""

from __future__ import annotations

import pytest

from pdplane.cli import up


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--mean-gpus", "4"], "--mean-gpus"),
        (["--mean-gpus=4"], "--mean-gpus"),
        (["--engine", "sim", "--max-prefill", "3"], "--max-prefill"),
    ],
)
def test_a_controller_flag_without_autoscale_exits_2_naming_it(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        up.parse(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "--autoscale" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--autoscale", "--mean-gpus", "4", "--max-decode", "3"],
        ["--engine", "sim", "--prefill", "2"],
    ],
)
def test_controller_flags_with_autoscale_or_none_are_accepted(argv: list[str]) -> None:
    assert isinstance(up.parse(argv), up.UpSettings)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--slo", "bogus"], "bad SLO term 'bogus'"),
        (["--autoscale-profile", "nosuch"], "nosuch"),
        (["--prefill", "5", "--max-prefill", "4"], "--prefill 5 is outside"),
        (["--decode", "3", "--min-decode", "4"], "--decode 3 is outside"),
        (["--prefill", "3", "--decode", "3", "--gpus", "4"], "hold 6 GPUs, more than --gpus 4"),
    ],
)
def test_autoscale_with_a_bad_slo_profile_or_starting_fleet_exits_2_before_starting(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        up.parse(["--autoscale", "--engine", "sim", *argv])
    assert exited.value.code == 2
    assert said in capsys.readouterr().err


def test_a_bad_sim_profile_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        up.parse(["--engine", "sim", "--sim-profile", "nosuch.json"])
    assert exited.value.code == 2
    assert "--sim-profile" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("env", "value"),
    [("PDPLANE_GPUS", "1"), ("PDPLANE_MEAN_GPUS", "-3"), ("PDPLANE_MAX_PREFILL", "0")],
)
def test_the_controller_s_environment_is_ignored_without_autoscale(
    env: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docs/autoscale.md: the controller's PDPLANE_* variables are read only with --autoscale
    # (PDPLANE_GPUS is also `pdplane plan`'s --gpus).
    monkeypatch.setenv(env, value)
    settings = up.parse(["--engine", "sim"])
    assert not settings.autoscale and settings.gpus == 0 and settings.max_prefill == 8


def test_the_controller_s_environment_is_read_with_autoscale(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PDPLANE_GPUS", "1")
    with pytest.raises(SystemExit) as exited:
        up.parse(["--engine", "sim", "--autoscale"])
    assert exited.value.code == 2
    assert "gpus 1 is below the 2 GPUs" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag",
    [
        "--autoscale-interval-s",
        "--autoscale-window-s",
        "--up-margin",
        "--cooldown-s",
        "--instance-startup-s",
        "--drain-timeout-s",
        "--predict-measure-s",
        "--scale-in-after-s",
    ],
)
@pytest.mark.parametrize("value", ["inf", "nan"])
def test_a_controller_duration_or_margin_must_be_finite(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        up.parse(["--engine", "sim", "--autoscale", flag, value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "finite" in err
