"""Must show: the decode KV guard does not turn requests away once earlier ones ended.

A decode whose KV cache holds 10 requests serves 8 at a time through the gateway, with the
load reports of a real fleet (one per heartbeat): every request completes. The guard had
counted each report's running requests as holding their blocks until the next report, however
many of them had ended (34 of 48 requests answered 503 "no KV room" on vLLM CPU).
"""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.gateway.conftest import Stack
from tests.integration.gateway.helpers import SHORT_BODY
from tests.support.loadgen import completion_burst


@pytest.mark.parametrize("dispatch", ["sequential", "concurrent"])
def test_eight_at_a_time_on_a_small_decode_all_complete(stack_factory, dispatch: str) -> None:  # type: ignore[no-untyped-def]
    stack: Stack = stack_factory(dispatch=dispatch, embedded=True)
    # 401 prompt + 16 output tokens: 4 blocks of 128 of the decode's 40 (10 requests).
    sims = stack.sims(["prefill", "decode"], kv_blocks=40, block_size=128, itl_ms=2)
    stack.wait_ready(sims)
    statuses = asyncio.run(completion_burst(stack.url, SHORT_BODY, 64, 8))
    assert statuses == {200: 64}
