"""Streamed `n` > 1 across a lost decode: each unfinished choice continues on its own leg.

vLLM streams the choices of `n` > 1 from one decode, one choice per chunk with its `index`
(`vllm/entrypoints/openai/completion/serving.py`, `chat_completion/serving.py`: 0.32): a
chat stream opens with a role chunk per choice, each with the prompt's ids when asked for;
completions give them on each choice's first chunk. When that decode is lost the choices stop
together, each after its own number of tokens, and one resumed request cannot carry them (a
batch shares one `max_tokens`). So each unfinished choice continues as a stream of one choice
does (`pdplane.gateway.resume`): its own `/v1/completions` leg, scheduled on its
own, with its own tokens sent and what it has left. `Choices` follows the client's stream per
choice (a `pdplane.gateway.migration.Transcript` each); `FanOut` runs the choices' legs at once
and writes their events into the client's one stream under each choice's `index`, dropping
each leg's usage chunk and `[DONE]` for the stream's one of each at the end.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass

from pdplane.gateway.migration import Transcript
from pdplane.gateway.replies import SSE_DONE, SSE_ERROR
from pdplane.gateway.splice import FirstToken

__all__ = ["Choices", "FanOut", "Leg"]

#: An event's choice (the first `"index"` key: a choice's, before any nested object's).
_INDEX = re.compile(rb'"index":(\d+)')
#: A one-choice leg's choice index, as vLLM and `pdplane.gateway.splice.Splice` write it.
_LEG_INDEX = re.compile(rb'("choices":\[\{"index":)0(?=[,}])')
_DONE = SSE_DONE.rstrip(b"\n")  # as `events.split(b"\n\n")` leaves it
#: Events a leg writes that the client gets one of, at the end, for all choices.
_USAGE = b'"choices":[]'
#: Events a leg may write ahead of the client reading them (per choice).
_QUEUED = 32


class Choices:
    """The client's stream of `n` choices so far: one `Transcript` per choice, fed with the
    events of its `index` (the same interface as `Transcript`'s for the relay's read loop).

    Args:
        n: the request's `n` (> 1).
        lookback, text_offsets: as `Transcript`'s, for every choice.
    """

    __slots__ = ("choices",)

    def __init__(self, n: int, lookback: int | None = None, text_offsets: bool = False) -> None:
        self.choices = [Transcript(lookback=lookback, text_offsets=text_offsets) for _ in range(n)]

    strip = staticmethod(Transcript.strip)

    def _route(self, events: bytes) -> Iterator[tuple[Transcript, bytes]]:
        for event in events.split(b"\n\n"):
            found = _INDEX.search(event) if event else None
            if found is not None and int(found.group(1)) < len(self.choices):
                yield self.choices[int(found.group(1))], event + b"\n\n"

    def observe(self, events: bytes, resumed: bool = False) -> None:
        """Decode's whole SSE `events`, each given to its choice's transcript."""
        for transcript, event in self._route(events):
            transcript.observe(event, resumed)

    @property
    def reads_text(self) -> bool:
        """Whether `deliver` must see the client's events."""
        return self.choices[0].reads_text

    def deliver(self, events: bytes) -> None:
        """The client's `events`, each given to its choice's transcript."""
        for transcript, event in self._route(events):
            transcript.deliver(event)

    def resumable(self) -> bool:
        """Whether the choices can continue elsewhere: the prompt's ids and the response's id
        are known (from any choice: one that sent nothing yet gets them too, and continues
        from them, not as a request run again whole)."""
        known = next((t for t in self.choices if t.resumable()), None)
        if known is None:
            return False
        for t in self.choices:
            t.started = True
            if t.prompt_ids is None:
                t.prompt_ids = list(known.prompt_ids or ())
            if not t.response_id:
                t.response_id, t.created, t.model = known.response_id, known.created, known.model
        return True

    @property
    def finished(self) -> bool:
        """Every choice's finish_reason went out."""
        return all(t.finished for t in self.choices)

    @property
    def tokens(self) -> int:
        """Output tokens the client got, over all choices."""
        return sum(t.tokens for t in self.choices)

    def unfinished(self) -> list[tuple[int, Transcript]]:
        """(index, transcript) of each choice still to generate."""
        return [(i, t) for i, t in enumerate(self.choices) if not t.finished]

    def as_first_token(self) -> FirstToken:
        """The stream's head in the shape `Splice` continues (for its usage and end)."""
        return self.choices[0].as_first_token()


@dataclass(frozen=True, slots=True)
class Leg:
    """One choice's continuation.

    Attributes:
        index: the choice's `index` in the client's stream.
        events: its events as a stream of one choice continues them (index 0; its usage and
            `[DONE]` at the end, or one error event when it cannot continue).
        abandon: called when another choice ended the stream with its error, before
            `events` is closed: the leg's attempt is then released failed, not cancelled.
    """

    index: int
    events: AsyncGenerator[bytes, None]
    abandon: Callable[[], None]


def _as_choice(events: bytes, index: int) -> bytes:
    """A leg's `events` in the client's stream: under `index`, without usage or `[DONE]`."""
    out = []
    for event in events.split(b"\n\n"):
        if not event or event == _DONE or _USAGE in event:
            continue
        out.append(_LEG_INDEX.sub(rb"\g<1>%d" % index, event, count=1) + b"\n\n")
    return b"".join(out)


class FanOut:
    """The choices' legs run at once, their events in the client's one stream (`events`).

    Args:
        legs: one per unfinished choice.
        ending: the stream's end once every leg finished (its usage chunk if asked, then
            `[DONE]`), built when they have.
    """

    __slots__ = ("_ending", "_legs", "ok")

    def __init__(self, legs: list[Leg], ending: Callable[[], bytes]) -> None:
        self._legs = legs
        self._ending = ending
        self.ok = False  # every choice finished: the stream ended with [DONE]

    async def events(self) -> AsyncGenerator[bytes, None]:
        """The client's stream from the seam on. A leg's error event (its choice could not
        continue) ends it: the error goes out as the leg wrote it, and the other legs are
        abandoned and closed. Closed early (the client left), every leg is closed."""
        queue: asyncio.Queue[tuple[Leg, bytes | BaseException | None]] = asyncio.Queue(
            _QUEUED * len(self._legs)
        )

        async def pump(leg: Leg) -> None:
            try:
                async for out in leg.events:
                    await queue.put((leg, out))
                await queue.put((leg, None))
            except Exception as exc:  # the stream raises it
                await queue.put((leg, exc))

        tasks = [asyncio.create_task(pump(leg)) for leg in self._legs]
        running = len(tasks)
        try:
            while running:
                leg, out = await queue.get()
                if out is None:
                    running -= 1
                elif isinstance(out, BaseException):
                    raise out
                elif SSE_ERROR in out:
                    for other in self._legs:
                        if other is not leg:
                            other.abandon()
                    yield out
                    return
                else:
                    out = _as_choice(out, leg.index)
                    if out:
                        yield out
            self.ok = True
            yield self._ending()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for leg in self._legs:
                await leg.events.aclose()
