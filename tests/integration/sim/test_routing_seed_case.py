"""The routing benchmark's seed case, small: random decode choice piles up, pdplane's does not.

The seed's 1P7D failure (bench/routing/routing.py preset `seed-1p7d-mini`: ~1k-token prompts, push
mode into bounded receive buffers with overflow -> recompute, decode KV near full) through
the real gateway, registry and sims. Orderings only, never absolute times.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.routing.routing import preset_points, run_point
from tests.integration.sim.helpers import run_kept_up


@pytest.mark.timeout(1200)  # with the slower reruns (helpers.run_kept_up)
def test_random_decode_choice_piles_up_and_least_loaded_stays_balanced(tmp_path: Path) -> None:
    rows = ["seed-proxy:random", "pdplane:least_loaded"]
    got = run_kept_up(preset_points("seed-1p7d-mini", rows), tmp_path, run_point)
    rnd, ll = got["seed-proxy:random"], got["pdplane:least_loaded"]
    for r in (rnd, ll):
        assert r["ok"] > 0.5 * r["requests"], r
    # pdplane's policy: balanced decode KV, far fewer receive-buffer overflows than random.
    # Since a full fleet queues (the gateway's admission queue) instead of answering 503 (94
    # of 1,016 here before), every request runs and a few pushes meet a full buffer (the push
    # is refused and decode loads the blocks another way): the scheduler counts the pushes of
    # assignments made since a load report, not those of earlier ones still on their way when
    # the report was taken. How many depends on the host's timing, not on the policy alone:
    # 0-6 of 1,016 measured here (0 with two CPU hogs beside it), 13 once on a CI host whose
    # sims kept up (lag < 0.1); random's 60-74 quiet, 431 busy. So the bound is against
    # random's in the same run (half or fewer; 12x fewer quiet), not an absolute count.
    assert ll["decode_kv_max_over_mean"] <= 1.15, ll
    assert 2 * ll["push_refused"] <= rnd["push_refused"], (rnd, ll)
    # random: the pile-up of the seed's report, seen in the waiting queues and in what
    # overflowed or was preempted. Not in KV max/mean: random fills every decode's KV cache to
    # ~90 %+, so the ratio is squeezed towards 1 (1.03-1.08 measured) and its order against
    # least_loaded's (1.01-1.05) flips from run to run on a loaded machine.
    assert rnd["push_refused"] + rnd["preemptions"] > ll["push_refused"] + ll["preemptions"]
    assert rnd["decode_waiting_peak"] > ll["decode_waiting_peak"], (rnd, ll)
