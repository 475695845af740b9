"""HeartbeatBatcher: heartbeats that arrive while a batch is in flight go as one next batch,
each answered with its own result; a lost stream answers its batch UNAVAILABLE (a fake stream,
no gRPC server)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from pdplane.registry.worker.batcher import HeartbeatBatcher
from pdplane.v1 import registry_pb2
from pdplane.v1 import registry_workers_pb2 as workers_pb2


class FakeCall:
    """A Heartbeats stream whose answers the test releases one batch at a time."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.release = asyncio.Queue[Any]()

    async def write(self, batch: workers_pb2.HeartbeatBatch) -> None:
        self.batches.append([h.instance_id for h in batch.heartbeats])

    async def read(self) -> Any:
        answer = await self.release.get()
        if isinstance(answer, BaseException):
            raise answer
        if answer is grpc.aio.EOF:
            return answer
        ids = self.batches[-1]
        return workers_pb2.HeartbeatBatchResult(
            results=[
                workers_pb2.HeartbeatResult(code=5, details=f"{i} unknown")
                if i.startswith("gone")
                else workers_pb2.HeartbeatResult(
                    response=registry_pb2.HeartbeatResponse(lease_ttl_ms=len(i))
                )
                for i in ids
            ]
        )

    def cancel(self) -> None:
        pass


class FakeStub:
    def __init__(self) -> None:
        self.calls: list[FakeCall] = []

    def Heartbeats(self, metadata: Any = None) -> FakeCall:
        self.calls.append(FakeCall())
        return self.calls[-1]


def _beat(instance_id: str) -> registry_pb2.HeartbeatRequest:
    return registry_pb2.HeartbeatRequest(instance_id=instance_id, lease_id="l")


async def _until(predicate: Any, timeout_s: float = 5.0) -> None:
    """Yields to the batcher until `predicate()` holds (at most `timeout_s`)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.001)


async def test_heartbeats_arriving_during_a_batch_go_together_each_with_its_own_answer() -> None:
    stub = FakeStub()
    batcher = HeartbeatBatcher(stub, ())  # type: ignore[arg-type]
    carrying = asyncio.create_task(batcher.run())
    first = asyncio.create_task(batcher.beat(_beat("a")))
    await _until(lambda: stub.calls and stub.calls[0].batches)
    call = stub.calls[0]
    # "a" is in flight: these three wait, then travel as one batch.
    rest = [asyncio.create_task(batcher.beat(_beat(i))) for i in ("bb", "gone-1", "dddd")]
    await _until(lambda: batcher.queued == 3)
    assert call.batches == [["a"]]
    call.release.put_nowait("answer")
    assert (await first).response.lease_ttl_ms == 1
    await _until(lambda: len(call.batches) == 2)
    assert call.batches[1] == ["bb", "gone-1", "dddd"]
    call.release.put_nowait("answer")
    results = await asyncio.gather(*rest)
    assert [(r.code, r.response.lease_ttl_ms) for r in results] == [(0, 2), (5, 0), (0, 4)]
    assert results[1].details == "gone-1 unknown"
    carrying.cancel()


async def test_a_lost_stream_answers_its_batch_unavailable_and_the_next_goes_on_a_new_one() -> None:
    stub = FakeStub()
    batcher = HeartbeatBatcher(stub, ())  # type: ignore[arg-type]
    carrying = asyncio.create_task(batcher.run())
    lost = asyncio.create_task(batcher.beat(_beat("a")))
    await _until(lambda: stub.calls and stub.calls[0].batches)
    stub.calls[0].release.put_nowait(grpc.aio.EOF)  # the store process went away
    result = await lost
    assert result.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert "store process unreachable" in result.details
    later = asyncio.create_task(batcher.beat(_beat("bb")))
    await _until(lambda: len(stub.calls) == 2 and stub.calls[1].batches)
    stub.calls[1].release.put_nowait("answer")
    assert (await later).response.lease_ttl_ms == 2
    carrying.cancel()


async def test_a_heartbeat_whose_caller_left_is_not_sent() -> None:
    stub = FakeStub()
    batcher = HeartbeatBatcher(stub, ())  # type: ignore[arg-type]
    carrying = asyncio.create_task(batcher.run())
    first = asyncio.create_task(batcher.beat(_beat("a")))
    await _until(lambda: stub.calls and stub.calls[0].batches)
    left = asyncio.create_task(batcher.beat(_beat("left")))
    stays = asyncio.create_task(batcher.beat(_beat("stays")))
    await _until(lambda: batcher.queued == 2)
    left.cancel()  # its stream closed while it waited
    stub.calls[0].release.put_nowait("answer")
    await first
    await _until(lambda: len(stub.calls[0].batches) == 2)
    assert stub.calls[0].batches[1] == ["stays"]
    stub.calls[0].release.put_nowait("answer")
    assert (await stays).code == 0
    carrying.cancel()
