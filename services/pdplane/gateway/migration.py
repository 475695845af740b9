"""What a stream needs to continue on another decode: the tokens the client already has.

A stream whose decode is lost mid-way (connection reset or closed before `[DONE]`, vLLM's
error event, silence past `--stream-idle-timeout-s`, the instance leaving the registry or
draining past `--drain-grace-s`) is resumed by the relay (`pdplane.gateway.resume`) on a new
decode: a `/v1/completions` request on the prompt's token ids plus the tokens already sent,
for what is left to generate (`pdplane.gateway.bodies.resumed_body`). Its events continue the
client's stream through a `pdplane.gateway.splice.Splice` that counts the tokens sent before.

`Transcript` follows the client's stream: the prompt's token ids, the ids of every token
relayed, whether a choice finished, the response's id / created / model. Decode legs of a
migratable stream ask for token ids (`return_token_ids`, vLLM's field), which the client did
not (`pdplane.gateway.bodies.migratable`): `Transcript.strip` takes them out again (vLLM
writes `null` then).
Every event is scanned with a few regular expressions (no JSON parse but the first event's).

Stop strings: vLLM holds back a stream's last (longest stop string - 1) characters until it
can tell they start none, so the tokens relayed before a seam may hold text the client never
got. A stream with stop strings (migratable only where the gateway has the model's tokenizer)
also counts the characters the client got (`Transcript.deliver`); `stop_seam` then finds the
last token whose text the client has in full and at least (longest stop string - 1)
characters before the end, the new leg generates from there, and the characters of its text
the client already has are dropped (`pdplane.gateway.splice.Splice`'s `overlap`). A stop
string spanning the seam lies wholly in the new leg's text, where vLLM finds it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic_core import from_json

from pdplane.gateway.seam import parsed
from pdplane.gateway.splice import FirstToken, strip_token_ids

__all__ = ["Budget", "Loss", "Transcript", "stop_lookback", "stop_seam", "whole_characters"]

#: A UTF-8 character spans at most 4 bytes, so at most 4 byte tokens.
_MAX_CHARACTER_TOKENS = 4

#: A token event's output ids (`"token_ids":[...]`; not `prompt_token_ids`, whose quote is
#: before `prompt_`).
_IDS = re.compile(rb'"token_ids":\[([0-9,]*)\]')
_PROMPT_IDS = re.compile(rb'"prompt_token_ids":\[([0-9,]*)\]')
#: A choice that finished (its reason a string; null while it streams).
_FINISHED = b'"finish_reason":"'
#: A token event's text (completions' `text`, chat's `content`) as a JSON string.
_TEXT = re.compile(rb'"(?:text|content)":("(?:[^"\\]|\\.)*")')


def _ints(data: bytes) -> list[int]:
    return [int(x) for x in data.split(b",")] if data else []


@dataclass(frozen=True, slots=True)
class Loss:
    """Why a stream's decode leg ended before its `[DONE]`.

    Attributes:
        reason: the `pdplane_gateway_migrations_total` label: `lost` (connection reset or
            closed), `idle` (silent past `--stream-idle-timeout-s`), `error_event` (decode
            sent vLLM's error event), `deregistered` (the instance left the registry),
            `drain` (the instance was draining past `--drain-grace-s`).
        status: the HTTP status of the error event the client gets if the stream cannot
            continue (502, 504, or decode's own event's).
        message: what happened, naming the instance.
        event: decode's own error event (bytes), relayed as is when the stream cannot continue.
    """

    reason: str
    status: int
    message: str
    event: bytes = b""

    @property
    def decode_alive(self) -> bool:
        """The decode answered (its own error event): no restart of it is coming, so a stream
        with no other decode does not wait for one."""
        return self.reason == "error_event"


@dataclass(slots=True)
class Budget:
    """A request's migrations so far (`--migration-limit`, `--migration-timeout-s`), shared by
    the choices of a streamed `n` > 1 (`pdplane.gateway.fanout`).

    Attributes:
        used: decode legs lost and continued elsewhere (resumes counted).
        since: time.perf_counter() at the first loss (0: none yet).
    """

    used: int = 0
    since: float = 0.0


def stop_lookback(body: dict[str, Any]) -> int | None:
    """The longest of the request's (`body`, parsed) `stop` strings less one (characters):
    what vLLM holds back of a stream; None without stop strings."""
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    lengths = [len(s) for s in stops if isinstance(s, str) and s]
    return max(lengths) - 1 if lengths else None


class Transcript:
    """The client's stream so far, as a resumed leg needs it (see the module docstring).

    Args:
        first: prefill's first token when the stream began with it (its prompt ids, the
            response's id, and one token sent).
        lookback: `stop_lookback` of the request (None: no stop strings); with stop strings
            the characters of text the client gets are counted (`deliver`).
        text_offsets: follow completions' `text_offset` as the client gets it (`deliver`),
            so that a resumed leg's, counted from its own start, go on from it.
    """

    __slots__ = (
        "created",
        "delivered",
        "finished",
        "lookback",
        "model",
        "next_offset",
        "offsets",
        "prompt_ids",
        "response_id",
        "sent",
        "started",
    )

    def __init__(
        self,
        first: FirstToken | None = None,
        lookback: int | None = None,
        text_offsets: bool = False,
    ) -> None:
        self.lookback = lookback
        # each token's text_offset as the client got it, and the next token's (None: not
        # followed); vLLM advances it by each token's text, not by the text streamed
        self.offsets: list[int] | None = [] if text_offsets else None
        self.next_offset = 0
        self.delivered = 0  # characters of text the client got (counted with stop strings)
        self.prompt_ids: list[int] | None = None
        self.sent: list[int] = []  # ids of the output tokens relayed, in order
        self.finished = False  # a finish_reason went out: nothing left to generate
        self.started = first is not None  # an event reached the client
        self.response_id = ""
        self.created = 0
        self.model = ""
        if first is not None:
            self.prompt_ids = list(first.prompt_token_ids)
            self.sent.append(first.token_id)
            self.response_id, self.created, self.model = (
                first.response_id,
                first.created,
                first.model,
            )

    def observe(self, events: bytes, resumed: bool = False) -> None:
        """Reads decode's whole SSE `events` (bytes) before they are relayed. `resumed`: a
        resumed leg's events (their prompt ids are the resumed prompt's, not the client's)."""
        if not events:
            return
        self.started = True
        if not self.response_id and events.startswith(b"data: {"):
            self._head(events[6 : events.find(b"\n\n")])
        if self.prompt_ids is None and not resumed:
            found = _PROMPT_IDS.search(events)
            if found is not None:
                self.prompt_ids = _ints(found.group(1))
        for ids in _IDS.findall(events):
            if ids:
                self.sent.extend(map(int, ids.split(b",")))
        if not self.finished and _FINISHED in events:
            self.finished = True

    @property
    def tokens(self) -> int:
        """Output tokens the client got."""
        return len(self.sent)

    @property
    def reads_text(self) -> bool:
        """Whether `deliver` must see the client's events."""
        return self.lookback is not None or self.offsets is not None

    def deliver(self, events: bytes) -> None:
        """Reads `events` (SSE bytes, as the client gets them): counts the characters of
        their text (with stop strings), follows completions' `text_offset`."""
        if self.lookback is not None:
            for found in _TEXT.finditer(events):
                text = found.group(1)
                # escapes (a lone surrogate's too) as the client's JSON parser reads them
                n = len(json.loads(text)) if b"\\" in text else len(text.decode()) - 2
                self.delivered += n
        if self.offsets is not None and b'"text_offset":[' in events:
            for event in events.split(b"\n\n"):
                if event.startswith(b"data: {"):
                    self._offsets(parsed(event[6:]))

    def _offsets(self, obj: Any) -> None:
        choices = obj.get("choices") if isinstance(obj, dict) else None
        for choice in choices if isinstance(choices, list) else ():
            logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
            if not isinstance(logprobs, dict):
                continue
            offsets, tokens = logprobs.get("text_offset"), logprobs.get("tokens")
            if isinstance(offsets, list) and offsets and isinstance(tokens, list) and tokens:
                assert self.offsets is not None
                self.offsets += offsets
                self.next_offset = offsets[-1] + len(str(tokens[-1]))

    @staticmethod
    def strip(events: bytes) -> bytes:
        """`events` with the token ids that only the gateway asked for set to null, as vLLM
        writes them when not asked."""
        return strip_token_ids(events)

    def _head(self, event: bytes) -> None:
        try:
            obj = from_json(event)
        except ValueError:
            return
        if isinstance(obj, dict) and isinstance(obj.get("id"), str):
            self.response_id = obj["id"]
            created = obj.get("created")
            self.created = created if isinstance(created, int) else 0
            model = obj.get("model")
            self.model = model if isinstance(model, str) else ""

    def resumable(self) -> bool:
        """Whether the stream can continue elsewhere: its prompt's ids and response id are
        known."""
        return self.prompt_ids is not None and bool(self.response_id)

    def rewind(self, keep: int) -> None:
        """Forgets the tokens sent after the first `keep` (their text never reached the
        client: `whole_characters`); a resumed leg generates them again."""
        if self.offsets is not None and keep < len(self.offsets):
            self.next_offset = self.offsets[keep]
            del self.offsets[keep:]
        del self.sent[keep:]

    def resumed_prompt(self) -> list[int]:
        """The new decode's prompt: the prompt's ids plus the tokens sent."""
        assert self.prompt_ids is not None
        return [*self.prompt_ids, *self.sent]

    def as_first_token(self) -> FirstToken:
        """The stream so far in the shape `Splice` continues (its last token as the first)."""
        assert self.prompt_ids is not None
        return FirstToken(
            response_id=self.response_id,
            created=self.created,
            model=self.model,
            prompt_token_ids=self.prompt_ids,
            token_id=self.sent[-1] if self.sent else 0,
            text="",
            finish_reason=None,
            stop_reason=None,
        )


def whole_characters(
    context: list[int], sent: list[int], decode: Callable[[list[int]], str]
) -> int:
    """How many of the `sent` token ids end on a character boundary: all of them, less the
    last ones (at most 4) that end inside a UTF-8 character. vLLM holds such tokens' text back
    until the character completes, so the client never got it; a resumed leg primed with a
    prompt ending inside the character would not write it either (its detokenizer starts at
    the prompt's end). Resuming after the whole characters only, the new leg generates those
    tokens again, text and all. `context`: the prompt's ids (its last ones give the first
    tokens the bytes they may continue); `decode`: the model's ids -> text, special tokens
    kept."""
    ids = [*context[-8:], *sent]
    for drop in range(min(_MAX_CHARACTER_TOKENS, len(sent)) + 1):
        end = len(ids) - drop
        if not decode(ids[max(0, end - 12) : end]).endswith("\ufffd"):
            return len(sent) - drop
    return len(sent)  # not a character held open: keep everything


def stop_seam(
    context: list[int],
    sent: list[int],
    delivered: int,
    lookback: int,
    decode: Callable[[list[int]], str],
) -> tuple[int, int]:
    """Where a stream with stop strings resumes: (k, overlap), the first k of the `sent` ids
    and the characters of the new leg's text the client already has (to be dropped).

    k is the most tokens whose text (after the prompt `context`'s, as vLLM's detokenizer
    continues it) ends on a whole character, within the `delivered` characters the client
    got, and at least `lookback` (longest stop string - 1) characters before the end of the
    sent tokens' text: a stop string may begin in those last characters (vLLM held them back,
    or, with `include_stop_str_in_output`, sent them unchecked against what comes next), so
    the new leg generates them again and checks them. `decode`: the model's ids -> text,
    special tokens kept. Source: vLLM 0.32 `vllm/v1/engine/detokenizer.py`
    (`stop_buffer_length`, `check_stop_strings`)."""
    tail = context[-8:]
    base = decode(tail)

    def text(k: int) -> str:
        out = decode([*tail, *sent[:k]])
        # BPE decoders may join the tail's text with the tokens' (a space added or dropped)
        return out[len(base) :] if out.startswith(base) else decode(sent[:k])

    # (a character still open at the end is not text yet: vLLM counts none of it)
    limit = max(0, min(delivered, len(text(len(sent)).rstrip("\ufffd")) - lookback))
    for k in range(len(sent), 0, -1):
        got = text(k)
        if len(got) <= limit and not got.endswith("\ufffd"):
            return k, delivered - len(got)
    return 0, delivered
