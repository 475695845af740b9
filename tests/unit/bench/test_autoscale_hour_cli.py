"""bench/plan/autoscale_hour.py refuses numbers no run can take, before any run starts: one
argparse line and exit 2, not a traceback or a run that never ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--gpus", "0"], "argument --gpus: 0 is below 2"),
        (["--gpus", "8", "1"], "argument --gpus: 1 is below 2"),
        (["--jobs", "0"], "argument --jobs: 0 is below 1"),
        (["--mean-gpus", "-1"], "argument --mean-gpus: -1 is below 0"),
        (["--inflight-budget", "-1"], "argument --inflight-budget: -1 is below 0"),
        (["--inflight-budget", "nan"], "argument --inflight-budget: nan is below 0 or not finite"),
        (["--mean-gpus", "inf"], "argument --mean-gpus: inf is below 0 or not finite"),
        (["--jobs", "two"], "argument --jobs: not a number: 'two'"),
    ],
)
def test_bad_numbers_are_refused_before_any_run(args: list[str], said: str) -> None:
    # Its own session: a run that did start (the bug) is stopped with its worker processes.
    proc = subprocess.Popen(
        [sys.executable, "bench/plan/autoscale_hour.py", *args, "--out", "/nonexistent/x"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"{args} started a run instead of being refused") from None
    assert proc.returncode == 2, err
    assert said in err
    assert "Traceback" not in err
