"""`--help` of the commands shows the form that works, each default said once."""

from __future__ import annotations

import importlib
import re

import pytest

from pdplane.cli import drain, grpc
from pdplane.cli.main import COMMANDS
from pdplane.plan import __main__ as plan
from pdplane.plan.workload import SHAPES
from pdplane.sim.profiles import PROFILES


def _help(main: object, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        main(["--help"])  # type: ignore[operator]
    assert done.value.code == 0
    return capsys.readouterr().out


def test_grpc_help_shows_its_positional_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(grpc.main, capsys)
    usage = text.split("\n\n")[0]
    assert "ADDRESS" in usage and "METHOD" in usage and "[BODY]" in usage
    assert "list" in text and "Service/Method" in text and "JSON" in text


def test_drain_help_shows_the_positional_id(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(drain.main, capsys)
    assert "--instance-id" not in text
    assert "(required)" not in text
    assert "INSTANCE-ID" in text.split("\n\n")[0]


def test_drain_without_an_id_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert drain.main([]) == 2
    assert "instance id" in capsys.readouterr().err


def test_plan_help_lists_the_built_in_profiles_and_workloads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = " ".join(_help(plan.main, capsys).split())  # argparse wraps the lines
    for name in [*PROFILES, *SHAPES]:
        assert name in text, name


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_option_without_a_value_says_its_default_once_in_words(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    module = importlib.import_module(COMMANDS[command][0])
    text = _help(module.main, capsys)
    assert "null" not in text, text  # neither `{Path,null}` nor "(default: null)"
    options = re.split(r"\n  (?=-)", text)
    for option in options:
        assert option.count("(default:") <= 1, option
    if command in ("up", "vllm"):  # a None default the description says in words
        model = next(o for o in options if o.startswith("--model "))
        assert model.count("(default:") == 1, model
