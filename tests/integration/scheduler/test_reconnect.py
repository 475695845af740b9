"""The remote scheduler client finds a restarted scheduler fast and says when it is gone."""

from __future__ import annotations

import asyncio
import contextlib
import time

from pdplane.core.grpc.util import FAST_RECONNECT_OPTIONS
from pdplane.launch.ports import free_port_run
from pdplane.scheduler import RequestFeatures, SchedulerUnavailable
from pdplane.scheduler.remote import RemoteScheduler
from tests.integration.scheduler.conftest import Fleet, sees, wait_for
from tests.integration.scheduler.fixtures import running_scheduler_server


async def _first_success_s(client: RemoteScheduler, start: float, limit_s: float) -> float:
    """Seconds from `start` (clock time) to the first Schedule that succeeds."""
    n = 0
    while time.monotonic() - start < limit_s:
        n += 1
        try:
            await client.schedule(RequestFeatures(f"after-{n}", "tiny", 10))
            return time.monotonic() - start
        except SchedulerUnavailable:
            await asyncio.sleep(0.02)
    return float("inf")


async def test_reconnects_within_one_capped_backoff_and_reports_unreachable_meanwhile(
    fleet: Fleet,
) -> None:
    fleet.add("p0", "prefill")
    fleet.add("d0", "decode")
    port = free_port_run()
    client = RemoteScheduler(f"127.0.0.1:{port}", timeout_s=1.0)
    try:
        with running_scheduler_server(fleet.registry, port=port) as server:
            wait_for(sees(server, "p0", "d0"))
            await client.schedule(RequestFeatures("before", "tiny", 10))
            assert client.problem() is None
        # Down for 6 s: gRPC's default backoff (1 s, x1.6 per failed attempt) has grown to
        # several seconds by then; every call fails fast meanwhile.
        down_until = time.monotonic() + 6.0
        while time.monotonic() < down_until:
            with contextlib.suppress(SchedulerUnavailable):
                await client.schedule(RequestFeatures("down", "tiny", 10))
            await asyncio.sleep(0.1)
        assert client.problem() == f"scheduler unreachable at 127.0.0.1:{port}"
        with running_scheduler_server(fleet.registry, port=port) as server:
            up_at = time.monotonic()
            wait_for(sees(server, "p0", "d0"))
            took = await _first_success_s(client, up_at, limit_s=10.0)
            # At most one capped reconnect backoff (+20 % jitter) plus a second for the
            # connect and the call on a busy host: 1.6 s, against ~3 s or more with gRPC's
            # default backoff after 6 s down.
            max_backoff_s = dict(FAST_RECONNECT_OPTIONS)["grpc.max_reconnect_backoff_ms"] / 1000
            limit = 1.2 * max_backoff_s + 1.0
            assert took < limit, f"first Schedule after the restart succeeded {took:.2f} s late"
            assert client.problem() is None
    finally:
        await client.close()
