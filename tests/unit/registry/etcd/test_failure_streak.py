"""An etcd outage is logged once per streak, not once per retry (the loops retry every 0.1 s)."""

from __future__ import annotations

import logging

import pytest

from pdplane.registry.etcd.lease import FailureStreak


def test_a_streak_logs_one_warning_its_repeats_quietly_and_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("test.failure_streak")
    streak = FailureStreak(logger, "etcd watch")
    with caplog.at_level(logging.DEBUG, logger="test.failure_streak"):
        for _ in range(300):  # 30 s of an outage at one retry per 0.1 s
            streak.failed("UNAVAILABLE: connection refused")
        streak.ok()
        streak.ok()  # no streak: nothing to say
        streak.failed("UNAVAILABLE: again")
    loud = [(r.levelno, r.getMessage()) for r in caplog.records if r.levelno >= logging.INFO]
    assert loud == [
        (logging.WARNING, "etcd watch failed (UNAVAILABLE: connection refused); retrying"),
        (logging.INFO, "etcd watch back after 300 failed attempt(s)"),
        (logging.WARNING, "etcd watch failed (UNAVAILABLE: again); retrying"),
    ]
