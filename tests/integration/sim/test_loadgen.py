"""The relay benchmark's load generator against sims: counts good replies, flags bad ones."""

from __future__ import annotations

import httpx
import pytest

from pdplane.sim.testing import async_running_sims
from tests.support.loadgen import run_load
from tests.support.stats import percentile


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (
        50.0,
        99.0,
        100.0,
    )
    assert percentile([], 50) != percentile([], 50)  # NaN


async def test_load_generator_measures_complete_streams() -> None:
    async with async_running_sims("decode", itl_ms=1) as sims:
        # The sim's first request pays one-off set-up (0.9 s once on a loaded 2-core machine),
        # longer than the whole measured window below: take it before measuring.
        async with httpx.AsyncClient(timeout=30) as client:
            warm = await client.post(
                sims.urls[0] + "/v1/chat/completions",
                json={
                    "model": "sim-model",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 8,
                },
            )
        assert warm.status_code == 200, warm.text
        result = await run_load(
            sims.urls[0] + "/v1/chat/completions",
            concurrency=4,
            duration_s=0.5,
            warmup_s=0.1,
            max_tokens=8,
        )
        assert result.ok > 4 and result.errors == 0
        assert len(result.latencies_ms) <= result.ok
        assert result.p(50) >= 7  # 8 tokens at 1 ms ITL


@pytest.mark.parametrize("mode", ["drop", "http500"])
async def test_load_generator_counts_broken_replies_as_errors(mode: str) -> None:
    async with async_running_sims("decode", failure_rate=1.0, fail_mode=mode) as sims:
        result = await run_load(
            sims.urls[0] + "/v1/chat/completions",
            concurrency=2,
            duration_s=0.3,
            warmup_s=0.0,
            max_tokens=8,
        )
        assert result.ok == 0 and result.errors > 0 and result.first_error
