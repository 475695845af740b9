"""The spend account's credit (pdplane.autoscale.spend) and the flags that set the target."""

from __future__ import annotations

import pytest

from pdplane.autoscale.__main__ import AutoscaleSettings
from pdplane.autoscale.loop import AutoscaleMetrics
from pdplane.autoscale.observe import Observation, Traffic
from pdplane.autoscale.spend import SpendAccount
from pdplane.autoscale.state import FleetState
from pdplane.cli.up import UpSettings


def test_credit_is_earned_below_the_target_and_spent_above_it() -> None:
    a = SpendAccount(4)
    assert a.credit(0) == 0 and not a.affords(0, 5, hold_s=1)  # before anything was held
    a.record(0, 2)
    a.record(100, 6)
    # 4 GPUs x 100 s allowed, 2 x 100 held: 200 GPU-s of credit; then 2 over the target.
    assert a.credit(100) == pytest.approx(200)
    assert a.affords(100, 6, hold_s=100) and not a.affords(100, 6, hold_s=101)
    assert a.affords(100, 4, hold_s=1e9)  # within the target: always
    assert a.credit(200) == pytest.approx(0) and not a.affords(200, 5, hold_s=1)


def test_the_credit_is_that_of_the_last_window() -> None:
    a = SpendAccount(4, window_s=150)
    a.record(0, 2)
    a.record(100, 6)
    # Within [50, 200]: 2 x 50 + 6 x 100 held against 4 x 150: 100 over.
    assert a.credit(200) == pytest.approx(-100)
    a.record(200, 2)
    # Within [400, 550]: 2 GPUs all along: 300 under.
    assert a.credit(550) == pytest.approx(300)


def test_a_purchase_is_paid_for_with_the_credit_still_in_the_window_when_it_ends() -> None:
    # 70 s at 2 GPUs under a target of 8, then 8: 420 GPU-s of credit at 3,600 s, earned in
    # the window's first 70 s. 10 GPUs for 210 s spend 2 x 210 = 420 over the target, but
    # by then the 70 s that earned it have left the window: the purchase is not paid for.
    a = SpendAccount(8.0, window_s=3600)
    a.record(0, 2)
    a.record(70, 8)
    assert a.credit(3600) == pytest.approx(420)
    assert not a.affords(3600, 10, hold_s=210)
    # Young, the same account pays for exactly (gpus - target) x hold_s.
    assert a.affords(3000, 10, hold_s=210)
    a.record(3600, 10)
    assert a.credit(3600 + 210) < 0  # what holding them would have come to


@pytest.mark.parametrize("command", [AutoscaleSettings, UpSettings])
def test_both_commands_take_the_spend_target(command: type) -> None:
    required = (
        ["--model", "m", "--prefill-workload", "deployment/p", "--decode-workload", "deployment/d"]
        if command is AutoscaleSettings
        else ["--autoscale"]  # pdplane up reads the controller's settings only with it
    )
    s = command.parse([*required, "--mean-gpus", "4.5", "--spend-window-s", "7200"])
    c = s.controller("llama3-8b-h100")
    assert c.spend is not None
    assert (c.spend.account.mean_gpus, c.spend.account.window_s) == (4.5, 7200)
    assert command.parse(required).controller("llama3-8b-h100").spend is None  # default: none


def test_a_spend_target_below_the_smallest_fleet_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        UpSettings.parse(["--autoscale", "--mean-gpus", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error: pdplane up: mean-gpus 1 is below the 2 GPUs" in err  # no pydantic prefix


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--mean-gpus", "20", "--gpus", "8"], "mean-gpus 20 is above the 8 GPUs"),
        (["--mean-gpus", "17"], "mean-gpus 17 is above the 16 GPUs"),  # 8 + 8 instances
        (
            ["--autoscale-window-s", "5", "--autoscale-interval-s", "10"],
            "autoscale-window-s must be at least autoscale-interval-s",
        ),
    ],
)
def test_a_spend_target_above_the_cap_or_a_window_shorter_than_a_step_is_refused(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        UpSettings.parse(["--autoscale", *flags])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_the_credit_is_exported() -> None:
    metrics = AutoscaleMetrics()
    metrics.update(Observation(Traffic(1, 100, 10), {}), FleetState(), None, True, credit=-42.0)
    value = metrics.registry.get_sample_value("pdplane_autoscale_spend_credit_gpu_seconds")
    assert value == -42.0
