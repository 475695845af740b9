"""Stop strings as vLLM applies them to a request's output text, and what its stream shows.

vLLM 0.32 (`vllm/v1/engine/detokenizer.py`, `check_stop_strings`): after each step the new
characters, with up to one stop string's length before them, are searched for every stop
string in the order given; the first found ends the request (`finish_reason` "stop",
`stop_reason` the string) and the text is cut before it (after it with
`include_stop_str_in_output`). While a stream runs, its last (longest stop string - 1)
characters are held back, unless the stop strings are kept in the output: they may be the
start of a stop string the next tokens complete. The finished request's last chunk carries the
rest. The sim generates one token per step, so each token is one step here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["StopStrings", "Stopped", "parse_stop"]


@dataclass(frozen=True, slots=True)
class Stopped:
    """An answer with its stop strings applied.

    Attributes:
        deltas: the text each token's chunk streams (held-back characters go out later).
        text: the whole output text (the non-streamed answer's).
        stop: the stop string that ended it; None: it ran to its last token.
    """

    deltas: list[str]
    text: str
    stop: str | None


@dataclass(frozen=True, slots=True)
class StopStrings:
    """A request's `stop` strings (non-empty, in the order given) and
    `include_stop_str_in_output`."""

    stops: tuple[str, ...]
    include: bool

    def apply(self, pieces: list[str]) -> Stopped:
        """Stops `pieces` (each token's text, one token per step) at the first stop string;
        `deltas` has one entry per token up to and including the one that completed it."""
        hold = 0 if self.include else max(len(s) for s in self.stops) - 1
        text, sent = "", 0
        deltas: list[str] = []
        for piece in pieces:
            text += piece
            found = self._find(text, len(piece))
            if found is not None:
                stop, cut = found
                text = text[:cut]
                deltas.append(text[sent:])
                return Stopped(deltas, text, stop)
            upto = max(sent, len(text) - hold)
            deltas.append(text[sent:upto])
            sent = upto
        if deltas:  # the last token ends the request: its chunk carries what was held
            deltas[-1] += text[sent:]
        return Stopped(deltas, text, None)

    def _find(self, text: str, new_chars: int) -> tuple[str, int] | None:
        """(the stop string, where the text ends) when one ends in the `new_chars` last
        characters (vLLM's `check_stop_strings`)."""
        if not new_chars:
            return None
        for stop in self.stops:
            at = text.find(stop, max(0, len(text) + 1 - new_chars - len(stop)))
            if at >= 0:
                return stop, at + len(stop) if self.include else at
        return None


def parse_stop(body: dict[str, Any]) -> StopStrings | str | None:
    """The request's stop strings (None: none), or the 400 message for a bad `stop`."""
    stop = body.get("stop")
    if stop is None or stop == []:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        return "stop must be a string or a list of strings"
    if not all(stop):
        return "stop cannot contain an empty string."
    include = body.get("include_stop_str_in_output") is True
    return StopStrings(tuple(stop), include)
