"""Parsing and validation of OpenAI completions / chat requests, with vLLM's 4xx errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdplane.sim.logprobs import Logprobs, parse_logprobs
from pdplane.sim.stops import StopStrings, parse_stop
from pdplane.sim.tokens import Tokenizer, WordTokenizer, prompt_key

__all__ = ["SimApiError", "SimRequest", "parse_request"]


class SimApiError(Exception):
    """An OpenAI-style error: HTTP status, error type, message and the offending parameter."""

    def __init__(
        self, status: int, message: str, err_type: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        """vLLM's `ErrorResponse` JSON."""
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass(slots=True)
class SimRequest:
    """What the simulated engine needs from a request.

    Attributes:
        chat: chat completions (True) or completions (False).
        prompt_ids: prompt token ids (the sim's tokenizer, chat template included).
        prompt_tokens: prompt length (tokens).
        max_tokens: tokens to generate, already clamped to the context length.
        stream, include_usage: SSE streaming and `stream_options.include_usage`.
        key, seed: determine the output text (`prompt_key` of the prompt's token ids).
        echo_prompt: completions `echo` (the prompt text is prefixed to the output); None
            with `return_token_ids`, as vLLM then leaves the prompt text out.
        kv_transfer_params: the request's `kv_transfer_params` (None when absent).
        return_token_ids: vLLM's `return_token_ids`: the response carries the prompt's and
            the output's token ids.
        prompt_as_ids: a completions prompt given as token ids.
        stop: the `stop` strings (`pdplane.sim.stops`); None: none.
        logprobs: the logprobs asked for (`pdplane.sim.logprobs`); None: none.
        n: choices per prompt (vLLM's `n`).
        seeded: the request gave its own `seed`: choice i then samples with `seed` + i (as
            vLLM seeds a parallel-sampling child); without one every choice samples with
            the sim's seed (the sim's output is greedy-like: a function of prompt and seed).
    """

    chat: bool
    prompt_ids: list[int]
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    key: str
    seed: int
    echo_prompt: str | None
    kv_transfer_params: dict[str, Any] | None
    return_token_ids: bool = False
    prompt_as_ids: bool = False
    stop: StopStrings | None = None
    logprobs: Logprobs | None = None
    n: int = 1
    seeded: bool = False

    def seed_of(self, choice: int) -> int:
        """The seed choice `choice` samples with (see `seeded`)."""
        return self.seed + choice if self.seeded else self.seed


#: Below this temperature vLLM samples greedily (vllm/sampling_params.py, `_SAMPLING_EPS`).
_SAMPLING_EPS = 1e-5


def _bad(message: str, param: str | None = None) -> SimApiError:
    return SimApiError(400, message, "BadRequestError", param)


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(f"{name} must be an integer", name)
    if value < 0 or (value == 0 and name != "seed"):
        raise _bad(f"{name} must be at least 1, got {value}.", name)
    return value


#: The most choices a sim request may ask for (each is streamed per token).
_MAX_N = 16
#: Exclusive bound of a prompt token id (uint32 on the KV events wire).
_TOKEN_ID_LIMIT = 2**32


def _completion_prompt(body: dict[str, Any], tok: Tokenizer) -> tuple[list[int], str | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tok.encode(prompt), prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        # Token ids travel as uint32 (KV events): one outside that range used to raise inside
        # the engine loop, which then served nobody again.
        if not all(0 <= t < _TOKEN_ID_LIMIT for t in prompt):
            raise _bad(f"prompt token ids must be in [0, {_TOKEN_ID_LIMIT})", "prompt")
        return prompt, None
    raise _bad("prompt must be a string or a list of token ids (one prompt per request)", "prompt")


def _chat_prompt(body: dict[str, Any], tok: Tokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad("each message needs a string 'role'", "messages")
        _check_content(i, m.get("content"))
    return tok.encode_chat(messages)


def _check_content(i: int, content: Any) -> None:
    # vLLM's request model: content is a string, null, or a list of parts (objects); a text
    # part's `text` is a string. Anything else is its 400, not a TypeError deeper down.
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _bad(f"messages[{i}].content must be a string or a list of parts", "messages")
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise _bad(f"messages[{i}].content[{j}] must be an object", "messages")
        if part.get("type", "text") == "text" and not isinstance(part.get("text"), str):
            raise _bad(f"messages[{i}].content[{j}].text must be a string", "messages")


_DEFAULT_TOKENIZER = WordTokenizer()


def parse_request(
    body: Any,
    *,
    chat: bool,
    model: str,
    max_model_len: int,
    default_seed: int,
    tokenizer: Tokenizer | None = None,
) -> SimRequest:
    """Validates an OpenAI request body like vLLM does.

    Raises:
        SimApiError: 400 for malformed fields, a prompt longer than the context or `max_tokens`
            beyond `max_model_len`; 404 for an unknown model (vLLM's messages and shapes).
    """
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    if body.get("model") not in (None, model):
        raise SimApiError(
            404, f"The model `{body.get('model')}` does not exist.", "NotFoundError", "model"
        )
    n = _int_field(body, "n") or 1
    if n > _MAX_N:
        raise _bad(f"n must be at most {_MAX_N}", "n")
    temperature = body.get("temperature")
    greedy = isinstance(temperature, int | float) and temperature < _SAMPLING_EPS
    if greedy and n > 1:  # vLLM's SamplingParams._verify_greedy_sampling
        raise _bad(f"n must be 1 when using greedy sampling, got {n}.")
    tok = tokenizer or _DEFAULT_TOKENIZER
    as_ids = False
    if chat:
        prompt_ids = _chat_prompt(body, tok)
        echo = None
    else:
        prompt_ids, text = _completion_prompt(body, tok)
        echo = text if body.get("echo") is True else None
        as_ids = text is None
    return_token_ids = body.get("return_token_ids")
    if return_token_ids not in (None, True, False):
        raise _bad("return_token_ids must be a boolean", "return_token_ids")
    if return_token_ids:
        echo = None  # vLLM: with token ids, an echoed prompt is returned as ids, not text
    prompt_tokens = len(prompt_ids)
    name = "max_tokens"
    requested = _int_field(body, "max_tokens")
    if chat and body.get("max_completion_tokens") is not None:
        name, requested = "max_completion_tokens", _int_field(body, "max_completion_tokens")
    if requested is not None and requested > max_model_len:
        raise _bad(
            f"{name}={requested} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            name,
        )
    if prompt_tokens >= max_model_len:
        raise _bad(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {prompt_tokens} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
        )
    room = max_model_len - prompt_tokens
    max_tokens = room if requested is None else min(requested, room)
    stream = body.get("stream") is True
    options = body.get("stream_options")
    if options is not None and not stream:
        raise _bad("Stream options can only be defined when `stream=True`.", "stream_options")
    include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise _bad("kv_transfer_params must be an object", "kv_transfer_params")
    seed = _int_field(body, "seed")
    stop = parse_stop(body)
    if isinstance(stop, str):
        raise _bad(stop, "stop")
    logprobs = parse_logprobs(body, chat)
    if isinstance(logprobs, str):
        raise _bad(logprobs, "logprobs")
    return SimRequest(
        chat=chat,
        prompt_ids=prompt_ids,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        key=prompt_key(prompt_ids),
        seed=default_seed if seed is None else seed,
        echo_prompt=echo,
        kv_transfer_params=kv,
        return_token_ids=bool(return_token_ids),
        prompt_as_ids=as_ids,
        stop=stop,
        logprobs=logprobs,
        n=n,
        seeded=seed is not None,
    )
