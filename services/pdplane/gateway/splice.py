"""The SSE splice: a streamed request's first token from prefill, then decode's events.

Prefill computes the logits of the last prompt token anyway: its one output token IS the
request's first token. With `--first-token prefill` (the default) the gateway asks prefill for
token ids (`return_token_ids`, vLLM's field), writes that token to the client as soon as
prefill answered (`Splice.opening`), and then sends decode a `/v1/completions` request whose
prompt is prefill's prompt token ids plus that token, with one token less to generate
(`pdplane.gateway.bodies.continuation_body`). Decode loads the KV of prefill's tokens and
computes only the appended one (the connector accepts a prompt one token longer than
prefill's, `pdplane.connector.scheduler_side`): its first step yields the second token.
This is how DistServe (Zhong et al., OSDI 2024) and Splitwise (Patel et al., ISCA 2024) place the
first token: TTFT is the prefill phase. What moves is the gap between the first and second
token, which now holds the transfer and decode's admission.

Which requests take this path is `pdplane.gateway.bodies.takes_first_token`; a prefill that
returns no token ids (an older vLLM), or a first token without text when the gateway has no
tokenizer (`FirstToken.continuable`), takes the usual path. Decode's chunks are rewritten to
what the client's endpoint streams (`Splice.rewrite`): completions chunks pass as they are with
the response's id; chat chunks are built from decode's completions chunks (each event parsed:
any field order or spacing an engine writes); usage counts the first token as output, not
prompt; after a first token that ends inside a UTF-8 character, the text of decode's tokens up
to the character's end is rebuilt from their ids.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from json.encoder import encode_basestring_ascii
from typing import Any, Protocol

from pdplane.gateway.bodies import requested_max
from pdplane.gateway.replies import SSE_DONE, sse_event
from pdplane.gateway.seam import Seam, chat_logprobs, chat_top_logprobs, parsed
from pdplane.gateway.usage_details import with_cached_tokens
from pdplane.gateway.validation import CHAT, ClientRequest, Endpoint

__all__ = ["Detokenizer", "FirstToken", "Splice", "splice_for", "strip_token_ids"]


def _json_string(text: object) -> bytes:
    """`text` as `json.dumps` writes it (bytes): the JSON encoder's own string escaper."""
    if isinstance(text, str):
        return encode_basestring_ascii(text).encode()
    return json.dumps(text).encode()


@dataclass(frozen=True, slots=True)
class FirstToken:
    """Prefill's answer as the first token of the client's stream.

    Attributes:
        response_id: the client's response id (prefill's, e.g. "chatcmpl-<x-request-id>").
        created: the response's creation time (s since the epoch), prefill's.
        model: the served model name prefill answered with.
        prompt_token_ids: the prompt as prefill tokenized it (chat template applied).
        token_id: the first output token's id.
        text: its text.
        finish_reason: prefill's; "length" means only that prefill's one token was reached.
        stop_reason: prefill's (a stop token id, or None).
    """

    response_id: str
    created: int
    model: str
    prompt_token_ids: list[int]
    token_id: int
    text: str
    finish_reason: str | None
    stop_reason: int | str | None

    @classmethod
    def of(cls, endpoint: Endpoint, answer: dict[str, Any]) -> FirstToken | None:
        """From prefill's non-streamed answer (parsed); None without usable token ids."""
        choices = answer.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            return None
        choice = choices[0]
        prompt = answer.get("prompt_token_ids") if endpoint == CHAT else None
        if prompt is None:
            prompt = choice.get("prompt_token_ids")
        tokens = choice.get("token_ids")
        if endpoint == CHAT:
            message = choice.get("message")
            text = message.get("content") if isinstance(message, dict) else None
        else:
            text = choice.get("text")
        if (
            not isinstance(prompt, list)
            or not prompt
            or not all(type(t) is int for t in prompt)
            or not isinstance(tokens, list)
            or len(tokens) != 1
            or type(tokens[0]) is not int
            or not isinstance(text, str)
            # half a character flushed: decode's text would repeat it (U+FFFD inside is
            # text vLLM wrote whole, e.g. the pending text of a prompt that ends with it)
            or text.endswith("\ufffd")
        ):
            return None
        return cls(
            response_id=str(answer.get("id", "")),
            created=int(answer.get("created") or 0),
            model=str(answer.get("model", "")),
            prompt_token_ids=prompt,
            token_id=tokens[0],
            text=text,
            finish_reason=choice.get("finish_reason"),
            stop_reason=choice.get("stop_reason"),
        )

    def continuable(
        self,
        decode: Callable[[list[int]], str] | None,
        client_decode: Callable[[list[int]], str] | None = None,
        text_prompt: bool = False,
    ) -> bool:
        """Whether decode can continue after this token with the client's stream right. A
        token with text of its own, or one that ends the request ("stop"), is fine. A token
        without text is either one that ends inside a UTF-8 character (vLLM holds it back:
        its text comes with the next tokens, which `Splice` then rebuilds from their ids:
        `inside_character`) or one that decodes to nothing (a special token, an id past the
        tokenizer's vocabulary). Both need `decode` (the model's tokenizer: ids -> text,
        special tokens kept) to be told apart; without it such a token takes the usual
        path. So does one after a prompt (token ids) that itself ends inside a character:
        one instance's detokenizer then emits the prompt's bytes with the character's end,
        which decode's, primed further on, would not. `client_decode` is the prompt as the
        client's detokenizer sees it (special tokens skipped unless the client keeps them;
        default `decode`): a special token after the bytes hides nothing from it.
        `text_prompt`: the client sent its prompt as text (a completions string, chat
        messages), which ends on a whole character whatever it is; only a prompt of token ids
        can end inside one (its text ending with U+FFFD cannot tell the two apart)."""
        if self.text or self.finish_reason == "stop":
            return True
        if decode is None:
            return False
        return text_prompt or not (client_decode or decode)(self.prompt_tail()).endswith("\ufffd")

    def inside_character(self, decode: Callable[[list[int]], str] | None) -> bool:
        """Whether this token ends inside a UTF-8 character (`decode`: the model's ids ->
        text; False without it). vLLM streams such a token with text "" and the character
        with the token that completes it; decode's detokenizer, primed with a prompt that
        ends inside the character, would emit its prompt's text again with it."""
        if self.text or decode is None:
            return False
        # The prompt's tail gives the token the bytes it may continue; a token that adds
        # nothing to it (an id past the vocabulary) holds nothing, even after a tail that
        # ends with U+FFFD.
        tail = self.prompt_tail()
        text = decode([*tail, self.token_id])
        return text.endswith("\ufffd") and text != decode(tail)

    @property
    def decode_prompt(self) -> list[int]:
        """Decode's prompt when it continues after this token: prefill's prompt ids plus it
        (`pdplane.gateway.bodies.continuation_body`)."""
        return [*self.prompt_token_ids, self.token_id]

    def prompt_tail(self) -> list[int]:
        """The prompt's last ids: enough context for the bytes a token continues."""
        return self.prompt_token_ids[-8:]

    def ends_request(self, req: ClientRequest, max_model_len: int = 0) -> bool:
        """Whether the request ends with this token: a stop token, one token asked for, or a
        prompt one token short of `max_model_len` (tokens; 0 = unknown). There vLLM clamps
        `max_tokens` to the one token left, and would refuse decode's prompt, which is the
        model's whole length."""
        if self.finish_reason not in (None, "length") or requested_max(req) == 1:
            return True
        return 0 < max_model_len <= len(self.prompt_token_ids) + 1


class Detokenizer(Protocol):
    """A model's ids -> text (`pdplane.gateway.prompt_ids.PromptTokenizer`, a `tokenizers`
    `Tokenizer`): bytes that end inside a UTF-8 character decode to U+FFFD, ids the
    vocabulary lacks to nothing."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def splice_for(
    req: ClientRequest,
    first: FirstToken,
    tokenizer: Detokenizer | None,
    cached_tokens: int | None = None,
) -> Splice | None:
    """The client's stream from prefill's `first` token on, or None when decode cannot continue
    it right (`FirstToken.continuable`; the first token then comes from decode). Only a first
    token without text asks `tokenizer` (the model's; None: such a token takes the usual
    path): whether it ends inside a character, which the `Splice` then rebuilds with the
    client's detokenizer settings (special tokens skipped unless the client keeps them).
    `cached_tokens`: usage's `prompt_tokens_details.cached_tokens`, if asked."""
    kept = client = None
    if not first.text and tokenizer is not None:
        skip = req.body.get("skip_special_tokens") is not False
        kept = partial(tokenizer.decode, skip_special_tokens=False)
        client = partial(tokenizer.decode, skip_special_tokens=skip)
    text_prompt = req.endpoint == CHAT or isinstance(req.body.get("prompt"), str)
    if not first.continuable(kept, client, text_prompt):
        return None
    return Splice(req, first, client if first.inside_character(kept) else None, cached_tokens)


#: A `"token_ids"` or `"prompt_token_ids"` field with its list, for `strip_token_ids`.
_TOKEN_ID_LIST = re.compile(rb'("(?:prompt_)?token_ids":)\[[0-9,]*\]')


def _null_list(found: re.Match[bytes]) -> bytes:
    # A function, not the template rb"\1null": `re` expands a template in Python code per
    # match, at twice the cost of this call (~4 against ~2 us a token event).
    return found.group(1) + b"null"


def strip_token_ids(events: bytes) -> bytes:
    """SSE `events` (bytes) with every `token_ids` / `prompt_token_ids` list set to null, as
    vLLM writes them when the client did not ask for them (`return_token_ids`)."""
    return _TOKEN_ID_LIST.sub(_null_list, events)


class Splice:
    """The client's stream from the first token on: its events, then decode's rewritten.

    Args:
        req: the client's request (endpoint, `stream_options`).
        first: prefill's first token.
        decode: the model's ids -> text as the client's detokenizer makes it (special tokens
            skipped unless the client keeps them); given when `first` ends inside a UTF-8
            character (`FirstToken.inside_character`). Decode then streams its token
            ids (`token_ids`), and the text of its tokens up to the end of that character is
            rebuilt from them: vLLM's detokenizer on decode, primed with a prompt that ends
            inside the character, emits its prompt's text again with the character.
        cached_tokens: usage's `prompt_tokens_details.cached_tokens`, if asked.
        sent: output tokens the client had before decode's first (1: the first token; more
            for a stream resumed on another decode, `pdplane.gateway.migration`).
        seam: a resumed leg's fix-ups of decode's events (`pdplane.gateway.seam.Seam`: what
            the client already has, completions' `text_offset`).
    """

    __slots__ = (
        "_base",
        "_cached",
        "_chat",
        "_continuous",
        "_decode",
        "_first",
        "_head",
        "_held",
        "_ids",
        "_logprobs",
        "_seam",
        "_sent",
        "_stop_text",
        "_tail",
        "_token_frame",
        "_usage",
    )

    def __init__(
        self,
        req: ClientRequest,
        first: FirstToken,
        decode: Callable[[list[int]], str] | None = None,
        cached_tokens: int | None = None,
        sent: int = 1,
        seam: Seam | None = None,
    ) -> None:
        self._first = first
        self._sent = sent
        self._seam = seam
        self._cached = cached_tokens  # usage's prompt_tokens_details.cached_tokens, if asked
        self._decode = decode
        # Ids of the held character so far (the first token's, then decode's); None once
        # its text went out (or never held).
        self._held: list[int] | None = [first.token_id] if decode is not None else None
        self._tail = first.prompt_tail()
        self._base = decode(self._tail) if decode is not None else ""
        self._ids: tuple[bytes, bytes] | tuple[()] | None = None  # see _id_swap
        self._chat = req.endpoint == CHAT
        options = req.body.get("stream_options")
        options = options if isinstance(options, dict) else {}
        self._usage = bool(options.get("include_usage"))
        self._stop_text = req.body.get("include_stop_str_in_output") is True
        self._continuous = self._usage and bool(options.get("continuous_usage_stats"))
        obj = "chat.completion.chunk" if self._chat else "text_completion"
        self._head = {"id": first.response_id, "object": obj, "created": first.created}
        # A chat token chunk around its text's JSON string: what `_rewrite_event` writes for
        # a token's chunk (the same builder, so the same bytes).
        self._token_frame: tuple[bytes, bytes] | None = None
        #: chat's `top_logprobs` when the client asked for logprobs (chat's shape is built
        #: from decode's completions logprobs, `pdplane.gateway.seam.chat_logprobs`)
        self._logprobs = chat_top_logprobs(req.body) if self._chat else None
        if self._chat and self._logprobs is None:
            parts = self._token_chunk("\x00", None, None, None).split(b'"\\u0000"')
            if len(parts) == 2:
                self._token_frame = (parts[0], parts[1])

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> bytes:
        obj: dict[str, Any] = {**self._head, "model": self._first.model, "choices": choices}
        if usage is not None:
            obj["usage"] = usage
        return sse_event(obj)

    def _usage_of(self, completion_tokens: int) -> dict[str, Any]:
        prompt = len(self._first.prompt_token_ids)
        usage = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion_tokens,
            "completion_tokens": completion_tokens,
        }
        return usage if self._cached is None else with_cached_tokens(usage, self._cached)

    def _token_chunk(
        self, text: str, reason: str | None, stop_reason: object, usage: dict[str, Any] | None
    ) -> bytes:
        """One token's chunk as vLLM streams it on the client's endpoint."""
        choice: dict[str, Any] = {"index": 0}
        if self._chat:
            choice.update(delta={"content": text}, logprobs=None)
            choice["finish_reason"] = reason
            if reason is not None:
                choice["stop_reason"] = stop_reason
            choice["token_ids"] = None
        else:
            choice.update(text=text, logprobs=None, finish_reason=reason, stop_reason=stop_reason)
            choice.update(prompt_token_ids=None, token_ids=None)
        return self._chunk([choice], usage)

    def _role_chunk(self) -> bytes:
        """Chat's first chunk: the assistant role, no content yet."""
        delta = {"role": "assistant", "content": ""}
        obj: dict[str, Any] = {
            **self._head,
            "model": self._first.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
            "prompt_token_ids": None,
            "prompt_text": None,
        }
        if self._continuous:
            obj["usage"] = self._usage_of(0)
        return sse_event(obj)

    def opening(self) -> bytes:
        """The first token's events (chat: the role chunk, then the token's content)."""
        first = self._first
        usage = self._usage_of(1) if self._continuous else None
        token = self._token_chunk(first.text, None, None, usage)
        if self._chat:
            return self._role_chunk() + token
        return token

    def ending(self) -> bytes:
        """The whole stream of a request that ends with the first token
        (`FirstToken.ends_request`)."""
        first = self._first
        usage = self._usage_of(1) if self._continuous else None
        reason = first.finish_reason or "length"
        out = self._token_chunk(first.text, reason, first.stop_reason, usage)
        if self._chat:
            out = self._role_chunk() + out
        if self._usage:
            out += self._chunk([], self._usage_of(1))
        return out + SSE_DONE

    def closing(self) -> bytes:
        """The end of a stream whose last token already went out (its decode was lost after
        it, before its usage and `[DONE]`): the usage chunk if asked, then `[DONE]`."""
        usage = self._chunk([], self._usage_of(self._sent)) if self._usage else b""
        return usage + SSE_DONE

    @property
    def token_ids(self) -> bool:
        """Whether decode's leg must stream its token ids (`return_token_ids`)."""
        return self._decode is not None

    @property
    def passes_token_ids(self) -> bool:
        """Whether token ids in decode's events would reach the client through `rewrite`:
        completions chunks pass as they are, but chat's are rebuilt without them and held
        ones (`token_ids`) are taken out by `rewrite` itself."""
        return not self._chat and self._decode is None

    def rewrite(self, events: bytes) -> bytes:
        """Decode's whole SSE events (bytes) as the client's stream continues them."""
        if self._decode is not None:
            events = self._unhold(events)
        if self._seam is not None and self._seam.active:
            events = self._seam.rewrite(events)
        if not self._chat and b'"usage":{' not in events:
            # Completions chunks pass as they are, with the response's id (vLLM derives both
            # legs' ids from x-request-id, but need not).
            if self._ids is None:
                self._ids = self._id_swap(events)
            return events.replace(*self._ids) if self._ids else events
        if events.count(b"\n\n") == 1:  # one event, as a token's chunk mostly comes
            return self._rewrite_event(events[:-2])
        return b"".join([self._rewrite_event(e) for e in events.split(b"\n\n") if e])

    def _unhold(self, events: bytes) -> bytes:
        """Decode's events with the token ids the client did not ask for taken out, and,
        while the first token's character is held, each token event's text rebuilt from the
        ids: "" until the character is complete (as vLLM streams it), then its text."""
        if self._held is None:
            return strip_token_ids(events)
        out = []
        for event in events.split(b"\n\n"):
            if not event:
                continue
            if self._held is None or not event.startswith(b"data: {"):
                out.append(strip_token_ids(event) + b"\n\n")
                continue
            try:
                obj = json.loads(event[6:])
            except ValueError:
                out.append(event + b"\n\n")
                continue
            choices = obj.get("choices") if isinstance(obj, dict) else None
            for c in choices if isinstance(choices, list) else ():
                if not isinstance(c, dict):
                    continue
                ids = c.get("token_ids")
                if self._held is not None and isinstance(ids, list):
                    if ids and self._drops_stop_token(c):
                        ids = ids[:-1]  # vLLM leaves a stop token out of the text
                    c["text"] = self._held_text(ids)
                c["token_ids"] = None
                if "prompt_token_ids" in c:
                    c["prompt_token_ids"] = None
            out.append(sse_event(obj))
        return b"".join(out)

    def _drops_stop_token(self, choice: dict[str, Any]) -> bool:
        """Whether `choice` (decode's last) ended on a stop token (EOS or `stop_token_ids`;
        stop strings do not take this path) whose text vLLM's detokenizer leaves out."""
        if choice.get("finish_reason") != "stop" or self._stop_text:
            return False
        reason = choice.get("stop_reason")
        return reason is None or type(reason) is int

    def _held_text(self, ids: list[int]) -> str:
        """The text of decode's next tokens `ids` (one chunk) while the character is held:
        what one instance's detokenizer emits stepping through them one at a time. Each step
        emits the text so far unless it ends inside a character: "" until the character is
        complete, then its text and that of the tokens after it up to the last complete one
        (a chunk may hold several engine steps' tokens, and open another character)."""
        held, decode = self._held, self._decode
        assert held is not None and decode is not None
        done = ""  # the text so far at the chunk's last step that emitted
        for i in ids:
            if type(i) is not int:
                continue
            held.append(i)
            text = decode([*self._tail, *held])
            if not text.endswith("\ufffd"):
                base = self._base
                # BPE decoders may join the tail's text with the token's (a space added or
                # dropped): then only the held ids alone say what they hold.
                done = text[len(base) :] if text.startswith(base) else decode(held)
        if done:
            self._held = None  # decode's detokenizer is past the prompt's end from here on
        return done

    def _id_swap(self, events: bytes) -> tuple[bytes, bytes] | tuple[()]:
        """(decode's `"id":...` bytes, the response's) from decode's first event; () when
        they are the same."""
        head = events[: events.find(b"\n\n")]
        try:
            decode_id = json.loads(head[6:]).get("id") if head.startswith(b"data: {") else None
        except (ValueError, AttributeError):
            decode_id = None
        if not isinstance(decode_id, str) or decode_id == self._first.response_id:
            return ()
        field = b'"id":'
        return field + json.dumps(decode_id).encode(), field + json.dumps(
            self._first.response_id
        ).encode()

    def _rewrite_event(self, event: bytes) -> bytes:
        """One whole event of decode's as the client's stream continues it; `[DONE]`, error
        events and what does not parse pass as decode sent them."""
        obj = parsed(event[6:]) if event.startswith(b"data: {") else None
        if not isinstance(obj, dict) or "error" in obj:
            return event + b"\n\n"
        usage = obj.get("usage")
        if usage is None and self._token_frame is not None:
            # Most of a chat stream: one token's chunk, its text between the frame's two
            # halves (the bytes `_chunk` would write for it).
            choices = obj.get("choices")
            if type(choices) is list and len(choices) == 1:
                c = choices[0]
                if type(c) is dict and c.get("finish_reason") is None:
                    token = _json_string(c.get("text") or "")
                    return self._token_frame[0] + token + self._token_frame[1]
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            fixed = self._usage_of(usage["completion_tokens"] + self._sent)
            usage = {**usage, **fixed}
        else:
            usage = None
        if not self._chat:
            obj["id"] = self._first.response_id
            if usage is not None:
                obj["usage"] = usage
            return sse_event(obj)
        choices = obj.get("choices")
        choices = [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []
        out = []
        for c in choices:
            text, reason = c.get("text") or "", c.get("finish_reason")
            logprobs = c.get("logprobs")
            if self._logprobs is not None and isinstance(logprobs, dict):
                logprobs = chat_logprobs(logprobs, self._logprobs)
            else:
                logprobs = None
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": logprobs,
                "finish_reason": reason,
            }
            if reason is not None:
                choice["stop_reason"] = c.get("stop_reason")
            choice["token_ids"] = None
            out.append(choice)
        return self._chunk(out, usage)
