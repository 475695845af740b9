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
