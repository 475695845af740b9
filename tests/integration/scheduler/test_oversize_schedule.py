"""Must show: a Schedule over the scheduler's message limit is no capacity refusal.

gRPC answers a request message larger than the server's limit with its own
RESOURCE_EXHAUSTED, before the scheduler sees it. Read as SchedulerBusy, the gateway would
queue the request and send it again every 25 ms for the whole queue timeout, though room
can never help it; it is a SchedulerError (the gateway's 503 at once), on the unary call and
on the ScheduleStream. The Releases that rode on it never reached the scheduler: they are
sent again (not dropped as after a capacity refusal, which the scheduler applied them before).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pdplane.core.grpc.util import CONTROL_MAX_RECEIVE_BYTES
from pdplane.scheduler import RequestFeatures, SchedulerBusy, SchedulerError
from pdplane.scheduler.remote import RemoteScheduler
from pdplane.scheduler.server import SchedulerServer
from tests.integration.scheduler.conftest import Fleet


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
async def test_a_schedule_over_the_message_limit_is_not_busy(
    fleet: Fleet,
    scheduler_factory: Callable[..., SchedulerServer],
    client_factory: Callable[..., RemoteScheduler],
    stream: bool,
) -> None:
    fleet.add("p0", "prefill")
    fleet.add("d0", "decode")
    server = scheduler_factory()
    client = client_factory(server.address, stream=stream, release_batch_s=30.0)
    assert (await client.schedule(RequestFeatures("ok", "tiny", 16, 16))).decode is not None
    client.release_nowait("ok", "success")  # rides on the next Schedule: the huge one
    # 8-byte varints: twice the limit.
    hashes = tuple(range(2**62, 2**62 + CONTROL_MAX_RECEIVE_BYTES // 4))
    huge = RequestFeatures("huge", "tiny", 16, 16, prefix_block_hashes=hashes)
    with pytest.raises(SchedulerError) as caught:
        await client.schedule(huge)
    assert not isinstance(caught.value, SchedulerBusy), caught.value
    assert (await client.schedule(RequestFeatures("after", "tiny", 16, 16))).decode is not None
    assert server.app.service is not None
    assert set(server.app.service.inflight.request_ids()) == {"after"}
