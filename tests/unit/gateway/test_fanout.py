"""`Choices` follows each choice of a streamed n > 1 from its own events; `FanOut` writes the
choices' legs into one stream under their indexes, with one usage chunk and one [DONE]."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from pdplane.gateway.fanout import Choices, FanOut, Leg


def _event(index: int, text: str, ids: list[int], finish: str | None = None) -> bytes:
    reason = "null" if finish is None else f'"{finish}"'
    return (
        b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m",'
        b'"choices":[{"index":%d,"text":"%s","finish_reason":%s,"prompt_token_ids":[5,6],'
        b'"token_ids":%s}]}\n\n' % (index, text.encode(), reason.encode(), str(ids).encode())
    )


def test_each_choice_is_followed_from_the_events_of_its_index() -> None:
    choices = Choices(3)
    choices.observe(_event(0, "a", [10]) + _event(1, "b", [20]) + _event(0, "c", [11]))
    choices.observe(_event(1, "d", [21], "stop"))
    assert [t.sent for t in choices.choices] == [[10, 11], [20, 21], []]
    assert choices.resumable()  # choice 2 sent nothing: it gets the prompt and head too
    assert choices.choices[2].prompt_ids == [5, 6] and choices.choices[2].response_id == "cmpl-1"
    assert [i for i, _ in choices.unfinished()] == [0, 2]
    assert choices.tokens == 4 and not choices.finished


async def _leg(*chunks: bytes) -> AsyncGenerator[bytes, None]:
    for chunk in chunks:
        await asyncio.sleep(0)
        yield chunk


def test_the_legs_events_go_out_under_their_index_with_one_ending() -> None:
    usage = b'data: {"id":"x","choices":[],"usage":{"completion_tokens":3}}\n\n'
    done = b"data: [DONE]\n\n"
    legs = [
        Leg(i, _leg(_event(0, "x", [1]), _event(0, "y", [2], "length") + usage + done), list)
        for i in (0, 2)
    ]
    fan = FanOut(legs, lambda: b"END")

    async def run() -> list[bytes]:
        return [out async for out in fan.events()]

    out = asyncio.run(run())
    assert out[-1] == b"END" and fan.ok
    body = b"".join(out[:-1])
    assert body.count(b'"index":0') == 2 and body.count(b'"index":2') == 2
    assert b"[DONE]" not in body and b'"usage"' not in body


def test_a_legs_error_ends_the_stream_and_abandons_the_others() -> None:
    abandoned: list[int] = []
    error = b'data: {"error":{"message":"spent","code":502}}\n\n'

    async def forever() -> AsyncGenerator[bytes, None]:
        yield _event(0, "x", [1])
        await asyncio.Event().wait()
        yield b""  # never

    legs = [
        Leg(0, _leg(error), lambda: abandoned.append(0)),
        Leg(1, forever(), lambda: abandoned.append(1)),
    ]
    fan = FanOut(legs, lambda: b"END")

    async def run() -> list[bytes]:
        return [out async for out in fan.events()]

    out = asyncio.run(run())
    assert out[-1] == error and not fan.ok and abandoned == [1]
