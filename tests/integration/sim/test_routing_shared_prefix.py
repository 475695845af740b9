"""The routing benchmark's shared-prefix case, small: kv_aware goes where the prefix is cached.

bench/routing/routing.py preset `shared-prefix-mini` (2P2D, 8 tenants whose system prompts all fit a
decode instance's cache but only half of them a prefill's) through the real gateway, registry,
scheduler with its prefix index from the sims' own KV events, and sims. kv_aware sends each
prompt to the prefill that holds its tenant's prefix, so its prefills hit far more often than
round_robin's (which cycles every tenant through both caches) and it answers sooner. Both keep
every prefill leg: computing the question on a decode would lengthen that decode's step by more
than kv_aware's slack on this profile (docs/scheduler.md). Orderings only, never absolute
times.

The point is prewarmed (bench/routing/_prewarm.py): every decode instance computes each tenant's
system prompt and kv_aware's prefix index holds it before the replay, so the window measures
the steady state. Cold, the one-off pulls of each tenant's first copy on each decode fell
before or inside the window depending on the machine's load, and the KV ratio was luck.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.routing.routing import preset_points, run_point
from tests.integration.sim.helpers import run_kept_up


@pytest.mark.timeout(600)  # with the slower reruns (helpers.run_kept_up)
def test_kv_aware_prefills_where_the_prefix_is_cached_and_round_robin_does_not(
    tmp_path: Path,
) -> None:
    got = run_kept_up(preset_points("shared-prefix-mini"), tmp_path, run_point)
    kv, rr = got["pdplane:kv_aware"], got["pdplane:round_robin"]
    for r in (kv, rr):
        assert r["ok"] == r["requests"] > 0, r
        assert r["prewarm_requests"] > 0, r
    assert rr["prefill_legs_per_request"] > 0.9, rr
    assert kv["prefill_legs_per_request"] > 0.9, kv
    assert kv["prefill_hit_rate"] > rr["prefill_hit_rate"] + 0.1, (kv, rr)
    assert kv["ttft_p90_ms"] < rr["ttft_p90_ms"], (kv, rr)
