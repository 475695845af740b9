"""vLLM's OpenAI response bodies and SSE chunks (shapes as vLLM 0.32 serialises them)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

__all__ = ["ResponseWriter", "sse"]

_DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event `data: <json>\\n\\n`, as vLLM frames each chunk."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class ResponseWriter:
    """Builds the bodies of one request's response: non-streaming JSON or SSE chunks.

    With `prompt_ids` (the request set `return_token_ids`) the bodies carry token ids where
    vLLM 0.32 puts them: completions, on the choice (`prompt_token_ids` and the output's
    `token_ids`; streamed, `prompt_token_ids` on the first token's chunk only); chat,
    `prompt_token_ids` at the top level (streamed: on the role chunk) and `token_ids` on the
    choice (streamed: each chunk's delta tokens). Without it those fields stay null or absent.

    `n` > 1 as vLLM 0.32 streams it: each chunk carries one choice with its `index`; chat
    opens with one role chunk per choice (each with the prompt's ids when asked for);
    completions give the prompt's ids on each choice's first chunk.
    """

    __slots__ = (
        "_chat",
        "_created",
        "_finish",
        "_id",
        "_model",
        "_prompt_ids",
        "_prompt_sent",
        "_prompt_tokens",
    )

    def __init__(
        self, *, chat: bool, model: str, prompt_tokens: int, prompt_ids: list[int] | None = None
    ) -> None:
        self._chat = chat
        self._model = model
        self._prompt_tokens = prompt_tokens
        self._prompt_ids = prompt_ids  # None: token ids not asked for
        self._prompt_sent: set[int] = set()  # streaming: choices whose prompt ids went out
        self._created = int(time.time())
        self._id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        #: per choice, its last token's (finish_reason, stop_reason): a stop string's, else
        #: "length"
        self._finish: dict[int, tuple[str, str | None]] = {}

    def stopped_by(self, stop: str | None, index: int = 0) -> None:
        """Choice `index` ends on stop string `stop` (finish_reason "stop"); None: on its
        length."""
        self._finish[index] = ("length", None) if stop is None else ("stop", stop)

    def _finish_of(self, index: int) -> tuple[str, str | None]:
        return self._finish.get(index, ("length", None))

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        """OpenAI usage block (tokens)."""
        return {
            "prompt_tokens": self._prompt_tokens,
            "total_tokens": self._prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
        }

    def full(
        self,
        choices: list[tuple[str, list[int], dict[str, Any] | None]],
        kv_transfer_params: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """The non-streaming response: per choice (its text, its output ids, its logprobs
        (`pdplane.sim.logprobs`) or None), finish_reason "length" (the sim never samples
        EOS) or "stop" after `stopped_by`. The ids are returned only when the writer has
        `prompt_ids`; usage counts every choice's tokens, the prompt's once."""
        prompt_ids = self._prompt_ids
        out = []
        for index, (text, token_ids, logprobs) in enumerate(choices):
            out_ids = token_ids if prompt_ids is not None else None
            finish, stop = self._finish_of(index)
            if self._chat:
                choice: dict[str, Any] = {
                    "index": index,
                    "message": {
                        "role": "assistant",
                        "content": text,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "tool_calls": [],
                        "reasoning": None,
                    },
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "stop_reason": stop,
                    "token_ids": out_ids,
                }
            else:
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "stop_reason": stop,
                    "token_ids": out_ids,
                    "prompt_logprobs": None,
                    "prompt_token_ids": prompt_ids,
                }
            out.append(choice)
        return {
            "id": self._id,
            "object": "chat.completion" if self._chat else "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": out,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": self.usage(sum(len(ids) for _, ids, _ in choices)),
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_ids if self._chat else None,
            "kv_transfer_params": kv_transfer_params,
        }

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self._id,
            "object": "chat.completion.chunk" if self._chat else "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": choices,
        }

    def role_chunk(self, n: int = 1) -> bytes | None:
        """The chat stream's first events, one per choice of `n` (role, empty content; the
        prompt's ids when asked for); None for completions."""
        if not self._chat:
            return None
        out = []
        for index in range(n):
            delta = {"role": "assistant", "content": ""}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
            chunk = self._chunk([choice])
            if self._prompt_ids is not None:
                chunk["prompt_token_ids"] = self._prompt_ids
                chunk["prompt_text"] = None
                self._prompt_sent.add(index)
            out.append(sse(chunk))
        return b"".join(out)

    def token_chunk(
        self,
        text: str,
        last: bool,
        token_id: int | None = None,
        logprobs: dict[str, Any] | None = None,
        index: int = 0,
    ) -> bytes:
        """One streamed token of choice `index`; the choice's last one carries the
        finish_reason ("length", or "stop" after `stopped_by`).

        `token_id`: the token's id, returned only when the writer has `prompt_ids`;
        `logprobs`: the token's (`pdplane.sim.logprobs`), if asked.
        """
        choice: dict[str, Any]
        if self._chat:
            choice = {"index": index, "delta": {"content": text}, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs}
        finish, stop = self._finish_of(index)
        choice["finish_reason"] = finish if last else None
        ids = self._prompt_ids is not None
        completion_ids = ids and not self._chat
        if last or completion_ids:  # vLLM sets these on every completions chunk with ids
            choice["stop_reason"] = stop if last else None
        if completion_ids:
            sent = index in self._prompt_sent
            choice["prompt_token_ids"] = None if sent else self._prompt_ids
            self._prompt_sent.add(index)
        if ids:
            choice["token_ids"] = [] if token_id is None else [token_id]
        return sse(self._chunk([choice]))

    def usage_chunk(self, completion_tokens: int) -> bytes:
        """The `stream_options.include_usage` event: no choices, the usage block."""
        chunk = self._chunk([])
        chunk["usage"] = self.usage(completion_tokens)
        return sse(chunk)

    @staticmethod
    def done() -> bytes:
        """The stream terminator `data: [DONE]`."""
        return _DONE
