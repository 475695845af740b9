"""Several schedulers over one fleet decide as well as one (tests/support/replicas.py's scenario): 2
prefill + 4 decode sims, decodes 1-3 already running 40 long streams each (known to the
schedulers only from heartbeats), then a burst of 120 long streams split across two gateways.
The total decode load (pre + burst) must stay within max/mean 1.2 with least_loaded, which
balances request counts (kv_aware, the default, balances predicted step time, in which each new
1,000-token stream weighs its whole KV reservation: it ends near 1.15 either way)."""

from __future__ import annotations

import pytest

from tests.support import replicas

BOUND = 1.2  # max/mean of the total decode load


def test_two_schedulers_alone_herd_onto_the_least_loaded_decode() -> None:
    # The problem being solved: each counts only its own assignments between heartbeats.
    # (kv_aware, the default, herds less here: a decode's predicted step grows with the KV
    # each assignment reserves, so each replica alone spreads after ~20; docs/scheduler.md.)
    result = replicas.run(mode="remote", share=False, policy="least_loaded")
    assert result.started == 120 and result.failed == []
    assert result.burst[0] >= 80  # both send their first 40 to the idle decode 0
    assert result.max_over_mean > 1.4


@pytest.mark.parametrize("mode", ["remote", "embedded"])
def test_replicas_sharing_in_flight_state_balance_the_burst(mode: str) -> None:
    result = replicas.run(mode=mode, share=True, policy="least_loaded")
    assert result.started == 120 and result.failed == []
    assert result.max_over_mean <= BOUND, (result.burst, result.totals)


def test_a_scheduler_killed_mid_burst_loses_no_request() -> None:
    result = replicas.run(mode="remote", share=True, kill="scheduler")
    assert 0 < result.killed_at < 120  # SIGKILL with part of the burst still to schedule
    assert result.failed == []
    assert result.started == 120


def test_a_gateway_killed_mid_burst_loses_no_request_that_was_not_streaming() -> None:
    result = replicas.run(mode="embedded", share=True, kill="gateway")
    assert 0 < result.killed_at < 120
    # Streams the dead gateway was relaying end with it; every other request is served.
    assert result.failed == []
    assert result.started + result.cut == 120
