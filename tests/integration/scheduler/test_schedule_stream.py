"""`RemoteScheduler` over `ScheduleStream`: answers matched by call id, per-call deadlines, a
scheduler that goes away mid-stream, and the unary fallback. Stand-in schedulers on loopback
decide in the test (answers in any order, or none); the real scheduler's behaviour over the
stream is what the rest of this package tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from pdplane.scheduler import Decision, RequestFeatures, SchedulerError, SchedulerUnavailable
from pdplane.scheduler.remote import RemoteScheduler
from pdplane.scheduler.server import SchedulerServer
from pdplane.v1 import scheduler_pb2, scheduler_pb2_grpc


def _answer(call: scheduler_pb2.ScheduleCall, by: str) -> scheduler_pb2.ScheduleResult:
    # The reason names the request and the answering scheduler: what the client must get back.
    ref = scheduler_pb2.InstanceRef(instance_id=f"{by}-d", url="http://127.0.0.1:1")
    response = scheduler_pb2.ScheduleResponse(decode=ref, reason=f"{by}:{call.request.request_id}")
    return scheduler_pb2.ScheduleResult(call_id=call.call_id, response=response)


class _StandIn(scheduler_pb2_grpc.SchedulerServicer):
    """Answers every `batch` calls in reverse order; `hold`: never answers."""

    def __init__(self, name: str, batch: int = 1, hold: bool = False) -> None:
        self.name = name
        self.batch = batch
        self.hold = hold
        self.streams = 0
        self.calls: list[scheduler_pb2.ScheduleCall] = []
        self.messages = 0
        self.got_calls = asyncio.Event()

    async def ScheduleStream(
        self,
        request_iterator: AsyncIterator[scheduler_pb2.ScheduleCalls],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[scheduler_pb2.ScheduleResults]:
        self.streams += 1
        held: list[scheduler_pb2.ScheduleCall] = []
        async for message in request_iterator:
            self.messages += 1
            for call in message.calls:
                self.calls.append(call)
                self.got_calls.set()
                if self.hold:
                    continue
                held.append(call)
                if len(held) == self.batch:
                    # One message per answer: the client must not rely on the grouping.
                    for c in reversed(held):
                        yield scheduler_pb2.ScheduleResults(results=[_answer(c, self.name)])
                    held.clear()


class _UnaryOnly(scheduler_pb2_grpc.SchedulerServicer):
    """A scheduler from before ScheduleStream (UNIMPLEMENTED)."""

    def __init__(self) -> None:
        self.unary_calls = 0

    async def Schedule(
        self, request: scheduler_pb2.ScheduleRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ScheduleResponse:
        self.unary_calls += 1
        call = scheduler_pb2.ScheduleCall(request=request)
        return _answer(call, "unary").response


async def _serve(servicer: scheduler_pb2_grpc.SchedulerServicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _features(request_id: str) -> RequestFeatures:
    return RequestFeatures(request_id, "tiny", 16, 16)


async def test_concurrent_calls_get_their_own_answers_on_one_stream() -> None:
    stand_in = _StandIn("s", batch=8)  # answers each 8 calls in reverse order
    server, address = await _serve(stand_in)
    client = RemoteScheduler(address)
    try:
        ids = [f"r{i}" for i in range(64)]
        decisions = await asyncio.gather(*(client.schedule(_features(i)) for i in ids))
        assert [d.reason for d in decisions] == [f"s:{i}" for i in ids]
        assert stand_in.streams == 1
        assert len({c.call_id for c in stand_in.calls}) == 64
        # Calls made while a message was being written left together: fewer writes than calls.
        assert stand_in.messages < 64
    finally:
        await client.close()
        await server.stop(0)


async def test_a_call_without_an_answer_expires_and_the_stream_stays_usable() -> None:
    stand_in = _StandIn("s", batch=2)  # the first call alone gets no answer until a second
    server, address = await _serve(stand_in)
    client = RemoteScheduler(address, timeout_s=0.3)
    try:
        with pytest.raises(SchedulerUnavailable) as err:
            await client.schedule(_features("lonely"))
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        # The late answer to "lonely" comes with this call's; it is dropped, this one matched.
        assert (await client.schedule(_features("a"))).reason == "s:a"
        assert stand_in.streams == 1
    finally:
        await client.close()
        await server.stop(0)


async def test_calls_in_flight_when_their_scheduler_dies_go_to_the_next_one() -> None:
    doomed = _StandIn("doomed", hold=True)
    spare = _StandIn("spare")
    doomed_server, doomed_address = await _serve(doomed)
    spare_server, spare_address = await _serve(spare)
    client = RemoteScheduler(f"ipv4:{doomed_address},{spare_address}", timeout_s=5.0)
    try:
        calls = [asyncio.ensure_future(client.schedule(_features(f"r{i}"))) for i in range(4)]
        await asyncio.wait_for(doomed.got_calls.wait(), 5.0)
        await doomed_server.stop(0)  # the in-flight calls' stream breaks
        decisions = await asyncio.wait_for(asyncio.gather(*calls), 5.0)
        assert [d.reason for d in decisions] == [f"spare:r{i}" for i in range(4)]
    finally:
        await client.close()
        await spare_server.stop(0)


async def test_calls_in_flight_when_the_only_scheduler_dies_fail_unavailable() -> None:
    doomed = _StandIn("doomed", hold=True)
    server, address = await _serve(doomed)
    client = RemoteScheduler(address, timeout_s=5.0)
    try:
        calls = [asyncio.ensure_future(client.schedule(_features(f"r{i}"))) for i in range(4)]
        await asyncio.wait_for(doomed.got_calls.wait(), 5.0)
        await server.stop(0)
        results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 5.0)
        assert all(isinstance(r, SchedulerUnavailable) for r in results), results
        assert all(r.code == grpc.StatusCode.UNAVAILABLE for r in results)  # type: ignore[union-attr]
    finally:
        await client.close()


async def test_a_scheduler_without_the_stream_is_called_unary() -> None:
    unary = _UnaryOnly()
    server, address = await _serve(unary)
    client = RemoteScheduler(address)
    try:
        for rid in ("a", "b"):
            assert (await client.schedule(_features(rid))).reason == f"unary:{rid}"
        assert unary.unary_calls == 2
    finally:
        await client.close()
        await server.stop(0)


class _Both(_StandIn):
    """A scheduler with ScheduleStream and the unary Schedule, counting each."""

    def __init__(self) -> None:
        super().__init__("stream")
        self.unary = _UnaryOnly()

    async def Schedule(
        self, request: scheduler_pb2.ScheduleRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ScheduleResponse:
        return await self.unary.Schedule(request, context)


async def test_schedule_stream_off_sends_unary_calls_only() -> None:
    from pdplane.gateway.settings import GatewaySettings
    from pdplane.scheduler.factory import open_scheduler

    both = _Both()
    server, address = await _serve(both)
    # The gateway's setting (`--no-schedule-stream`, PDPLANE_SCHEDULE_STREAM=false) reaches
    # the client through the one factory.
    off = open_scheduler(GatewaySettings(scheduler=address, schedule_stream=False))
    on = open_scheduler(GatewaySettings(scheduler=address))
    try:
        for rid in ("a", "b"):
            assert (await off.schedule(_features(rid))).reason == f"unary:{rid}"
        assert (both.unary.unary_calls, both.streams) == (2, 0)
        assert (await on.schedule(_features("c"))).reason == "stream:c"
        assert (both.unary.unary_calls, both.streams) == (2, 1)
    finally:
        await off.close()
        await on.close()
        await server.stop(0)


async def test_the_trace_context_rides_in_each_call() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pdplane.core import tracing

    stand_in = _StandIn("s")
    server, address = await _serve(stand_in)
    client = RemoteScheduler(address)
    tracing.shutdown()
    assert tracing.configure("unit", exporter=InMemorySpanExporter())
    try:
        with tracing.span("gateway") as span:
            assert span is not None
            await client.schedule(_features("traced"))
        await client.schedule(_features("untraced"))
        traced, untraced = stand_in.calls
        assert traced.traceparent.split("-")[1] == format(span.get_span_context().trace_id, "032x")
        assert untraced.traceparent == ""
    finally:
        tracing.shutdown()
        await client.close()
        await server.stop(0)


async def test_one_failing_call_does_not_end_the_stream(
    pair_server: Callable[..., SchedulerServer], client_factory: Callable[..., RemoteScheduler]
) -> None:
    server = pair_server()
    service = server.app.service
    assert service is not None
    decide = service.schedule

    def schedule(features: RequestFeatures) -> Decision:
        if features.request_id == "poison":
            raise RuntimeError("a bug")
        return decide(features)

    service.schedule = schedule  # type: ignore[method-assign,assignment]
    client = client_factory(server.address)
    assert (await client.schedule(_features("before"))).decode.instance_id == "d0"
    stream = client._stream
    with pytest.raises(SchedulerError) as err:
        await client.schedule(_features("poison"))
    assert err.value.code == grpc.StatusCode.INTERNAL
    assert (await client.schedule(_features("after"))).decode.instance_id == "d0"
    assert client._stream is stream and stream is not None and not stream.ended


async def test_the_scheduler_answers_a_message_of_calls_in_one_message(
    pair_server: Callable[..., SchedulerServer],
) -> None:
    server = pair_server()
    service = server.app.service
    assert service is not None
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        first = scheduler_pb2.ScheduleCalls(
            calls=[
                scheduler_pb2.ScheduleCall(
                    call_id=i,
                    request=scheduler_pb2.ScheduleRequest(
                        request_id=f"r{i}", model="tiny", prompt_tokens=16, max_tokens=16
                    ),
                )
                for i in (7, 8)
            ]
            + [scheduler_pb2.ScheduleCall(call_id=9, request=scheduler_pb2.ScheduleRequest())]
        )
        release = scheduler_pb2.ReleaseRequest(
            request_id="r7", outcome=scheduler_pb2.OUTCOME_SUCCESS
        )
        bad = scheduler_pb2.ReleaseRequest(request_id="", outcome=scheduler_pb2.OUTCOME_SUCCESS)
        queue: asyncio.Queue[scheduler_pb2.ScheduleCalls | None] = asyncio.Queue()

        async def messages() -> AsyncIterator[scheduler_pb2.ScheduleCalls]:
            while (message := await queue.get()) is not None:
                yield message

        call = stub.ScheduleStream(messages())
        queue.put_nowait(first)
        answers = await asyncio.wait_for(call.read(), 5.0)
        assert isinstance(answers, scheduler_pb2.ScheduleResults)
        assert [r.call_id for r in answers.results] == [7, 8, 9]
        assert [r.code for r in answers.results] == [
            0,
            0,
            grpc.StatusCode.INVALID_ARGUMENT.value[0],
        ]
        assert answers.results[0].response.decode.instance_id == "d0"
        assert service.inflight.release("r8") is not None  # in flight, as decided
        # Releases with no call to ride on are applied, not answered.
        queue.put_nowait(scheduler_pb2.ScheduleCalls(releases=[release]))
        queue.put_nowait(
            scheduler_pb2.ScheduleCalls(
                calls=[scheduler_pb2.ScheduleCall(call_id=10, request=first.calls[0].request)]
            )
        )
        answers = await asyncio.wait_for(call.read(), 5.0)
        assert [r.call_id for r in answers.results] == [10]
        # An invalid Release ends the stream with INVALID_ARGUMENT, none of its batch applied.
        queue.put_nowait(scheduler_pb2.ScheduleCalls(releases=[release, bad]))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(call.read(), 5.0)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert service.inflight.release("r7") is not None  # r7 of call 10: still in flight
        queue.put_nowait(None)
