"""An attempt's after-care: `settle` alone decides the outcome, then releases, frees held KV
and counts cancellations, once."""

from __future__ import annotations

import asyncio

import pytest

from pdplane.core.kv_params import DecodeRequestParams
from pdplane.gateway.aftercare import Caretaker
from pdplane.gateway.errors import bad_gateway
from pdplane.gateway.metrics import GatewayMetrics
from pdplane.gateway.replies import RetryElsewhere
from pdplane.scheduler import Outcome
from tests.unit.gateway.conftest import FakeScheduler

PARAMS = DecodeRequestParams("r1", "t1", "p", "127.0.0.1:1", [0], 3, "L1", "tcp", 1)


class FakeAborter:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []

    async def abort(self, kv_endpoint: str, transfer_id: str, reason: str) -> bool:
        self.calls.append((kv_endpoint, transfer_id, reason))
        return True


def _caretaker() -> tuple[Caretaker, FakeScheduler, FakeAborter, GatewayMetrics]:
    sched, aborter, metrics = FakeScheduler([]), FakeAborter(), GatewayMetrics()
    return Caretaker(sched, aborter, metrics), sched, aborter, metrics  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("error", "succeeded", "outcome", "abort_reason", "cancellations"),
    [
        (None, True, Outcome.SUCCESS, None, 0),
        (None, False, Outcome.FAILED, "failed", 0),  # e.g. a stream ended by an error event
        (ValueError("boom"), False, Outcome.FAILED, "failed", 0),
        (asyncio.CancelledError(), False, Outcome.CANCELLED, "cancelled", 1),
        (GeneratorExit(), False, Outcome.CANCELLED, "cancelled", 1),
        (
            RetryElsewhere("decode", "d", bad_gateway("unreachable")),
            False,
            Outcome.FAILED,
            "retrying on another pair",
            0,
        ),
    ],
)
async def test_settle_decides_the_outcome_once(
    error: BaseException | None,
    succeeded: bool,
    outcome: Outcome,
    abort_reason: str | None,
    cancellations: int,
) -> None:
    caretaker, sched, aborter, metrics = _caretaker()
    care = caretaker.begin("r1")
    care.hold_kv(PARAMS)
    if succeeded:
        care.succeeded()
    assert care.settle(error) is outcome
    assert care.settle(asyncio.CancelledError()) is outcome  # later calls change nothing
    await caretaker.drain()
    assert sched.log == [("release", outcome.value)]
    expected = [] if abort_reason is None else [("127.0.0.1:1", "t1", abort_reason)]
    assert aborter.calls == expected
    assert metrics.cancellations._value.get() == cancellations


async def test_kv_freed_early_is_not_aborted_again_and_no_kv_means_no_abort() -> None:
    caretaker, sched, aborter, _metrics = _caretaker()
    care = caretaker.begin("r1")
    care.hold_kv(PARAMS)
    care.free_kv("decode answered 400")
    care.settle(ValueError("4xx passed through"))
    bare = caretaker.begin("r2")
    bare.settle(asyncio.CancelledError())  # cancelled while scheduling: nothing held yet
    await caretaker.drain()
    assert aborter.calls == [("127.0.0.1:1", "t1", "decode answered 400")]
    assert sched.log == [("release", "failed"), ("release", "cancelled")]


async def test_a_prefill_call_given_up_on_frees_the_kv_by_the_transfer_id_it_was_given() -> None:
    # Cancelled with the call in flight: prefill may have finished and hold the KV under the
    # id the gateway chose; once it answered, its own params count; an error answer holds none.
    caretaker, _sched, aborter, _metrics = _caretaker()
    cancelled = caretaker.begin("r1")
    cancelled.expect_kv("127.0.0.1:2", "r1.chosen")
    cancelled.settle(asyncio.CancelledError())
    answered = caretaker.begin("r2")
    answered.expect_kv("127.0.0.1:2", "r2.chosen")
    answered.hold_kv(PARAMS)
    answered.settle(ValueError("decode failed"))
    refused = caretaker.begin("r3")
    refused.expect_kv("127.0.0.1:2", "r3.chosen")
    refused.nothing_held()  # prefill answered 400
    refused.settle(ValueError("400 passed through"))
    await caretaker.drain()
    assert aborter.calls == [
        ("127.0.0.1:2", "r1.chosen", "cancelled"),
        ("127.0.0.1:1", "t1", "failed"),
    ]
