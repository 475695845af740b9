"""Validation of client requests: the few fields the gateway reads, checked before any upstream.

The gateway forwards the client's body unchanged to decode, so it validates only what it uses
itself (model, prompt/messages, streaming and length fields) and leaves everything else to vLLM.
Types are checked strictly (`"stream": "yes"` or `"max_tokens": "5"` is a 400 here). Where vLLM
refuses the same request, the message is vLLM's own (an empty prompt or conversation), and like
`vllm serve` a request without `model` is for the default model (`ClientRequest.model` is then
"", resolved against the fleet by the endpoint).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SkipValidation,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)

from pdplane.gateway.errors import bad_request
from pdplane.gateway.json_guard import check_prompt, load_json
from pdplane.gateway.prompt_length import estimate_chat_tokens, estimate_prompt_tokens

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "EMPTY_CONVERSATION",
    "EMPTY_PROMPT",
    "REQUEST_SCHEMAS",
    "ClientRequest",
    "Endpoint",
    "parse_request",
]

Endpoint = Literal["/v1/completions", "/v1/chat/completions"]
COMPLETIONS: Endpoint = "/v1/completions"
CHAT: Endpoint = "/v1/chat/completions"

_TokenIds = list[Annotated[StrictInt, Field(ge=0)]]


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool | None = None


#: vLLM 0.32's answers to an empty or missing prompt and to an empty conversation.
EMPTY_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)"
EMPTY_CONVERSATION = (
    "Cannot apply chat template to an empty conversation. Provide at least one message."
)


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Annotated[StrictStr, Field(min_length=1)] | None = None
    stream: StrictBool | None = False
    stream_options: _StreamOptions | None = None
    max_tokens: StrictInt | None = None
    min_tokens: StrictInt | None = None
    n: StrictInt | None = None
    user: StrictStr | None = None
    priority: Annotated[StrictInt, Field(ge=-(2**31), lt=2**31)] | None = None
    use_beam_search: StrictBool | None = None


class _Completion(_Common):
    # Checked by `check_prompt` (cheap for long id lists); the type is for the schema.
    prompt: SkipValidation[StrictStr | list[StrictStr] | _TokenIds | list[_TokenIds] | None] = None


class _Chat(_Common):
    messages: list[dict[str, Any]]
    max_completion_tokens: StrictInt | None = None


#: The request body models of the two relay endpoints, for /openapi.json (the fields the gateway
#: reads; every other field goes to vLLM unchanged).
REQUEST_SCHEMAS: dict[Endpoint, type[BaseModel]] = {COMPLETIONS: _Completion, CHAT: _Chat}


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """A validated client request.

    Attributes:
        endpoint: the OpenAI path it arrived on (and is forwarded to).
        body: the client's JSON object, unchanged (the decode leg sends it plus kv_transfer_params).
        raw: the client's body bytes as received (`body` before parsing).
        model: served model name; "" when the client named none (the default model).
        stream: whether the client asked for SSE.
        prompt_tokens: prompt length estimate for Schedule (tokens; see
            `pdplane.gateway.prompt_length`).
        max_tokens: tokens to generate if the client said so, else 0 (unknown).
        routing_key: consistent-hash key (`X-Routing-Key` header, else the `user` field).
        prefix_hashes: block size -> the prompt's exact block hashes, set with the exact
            `prompt_tokens` by `pdplane.gateway.prompt_ids` when the model's tokenizer is known.
        priority: vLLM's `priority` field (lower is served first), None when absent.
        prompt_ids: the prompt's token ids (`array("I")` from `pdplane.gateway.prompt_ids`: 4 bytes
            a token), set with `prefix_hashes` (a prefix warm sends a
            part of them, `pdplane.gateway.warm`); empty when unknown.
    """

    endpoint: Endpoint
    body: dict[str, Any]
    raw: bytes
    model: str
    stream: bool
    prompt_tokens: int
    max_tokens: int
    routing_key: str
    prefix_hashes: Mapping[int, Sequence[int]] = field(default_factory=dict)
    priority: int | None = None
    prompt_ids: Sequence[int] = ()


_UNION_TAGS = frozenset({"str", "int", "bool", "float"})


def _first_error(exc: ValidationError) -> tuple[str, str]:
    err = exc.errors()[0]
    # Keep field names; drop list indices and pydantic's union-branch tags ("list[int]").
    names = [p for p in err["loc"] if isinstance(p, str) and "[" not in p and p not in _UNION_TAGS]
    param = ".".join(names)
    if err["type"] == "missing":
        return f"'{param}' is a required property", param
    return f"invalid value for '{param}': {err['msg']}", param


def _empty(prompt: object) -> bool:
    # "", [], [""] and [[]] are one empty prompt to vLLM.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    return prompt is None or len(prompt) == 0  # type: ignore[arg-type]


def _refuse_empty(req: _Completion | _Chat) -> None:
    if isinstance(req, _Completion) and _empty(req.prompt):
        raise bad_request(EMPTY_PROMPT, "prompt")
    if isinstance(req, _Chat) and not req.messages:
        raise bad_request(EMPTY_CONVERSATION)


def _refuse_unsupported(req: _Completion | _Chat) -> None:
    """Refuses what one prefill -> decode hand-off cannot serve correctly.

    A batched completions prompt becomes several engine requests on prefill, but vLLM returns a
    single `kv_transfer_params` for the whole response, so decode could load one prompt's KV for
    another; beam search forks sequences that a one-token prefill leg does not produce.
    """
    prompt = req.prompt if isinstance(req, _Completion) else None
    if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str | list):
        raise bad_request(
            f"batched prompts ({len(prompt)}) are not supported with prefill/decode "
            "disaggregation: send one prompt per request",
            "prompt",
        )
    if req.use_beam_search:
        raise bad_request(
            "beam search is not supported with prefill/decode disaggregation", "use_beam_search"
        )
    # Refused here as vLLM would refuse them on decode, before a prefill is spent on them.
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, name, None)
        if value is not None and value < 1:
            raise bad_request(f"{name} must be at least 1, got {value}.", name)
    if req.stream_options is not None and not req.stream:
        raise bad_request(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )


def parse_request(
    endpoint: Endpoint, raw: bytes, routing_key: str = "", *, max_model_len: int | None = None
) -> ClientRequest:
    """Parses and validates a client body for `endpoint`.

    Args:
        endpoint: COMPLETIONS or CHAT.
        raw: the HTTP body (UTF-8 JSON).
        routing_key: the `X-Routing-Key` header, "" when absent.
        max_model_len: the longest context of the served models (tokens), which bounds the
            number of JSON values a body may hold (`pdplane.gateway.json_guard`); None = no bound.

    Raises:
        GatewayError(400): not UTF-8 JSON, nested too deeply, a lone surrogate, far more values
            than the model length allows, not an object, a missing or empty `prompt` /
            `messages`, a wrong type in a field the gateway reads, a batched prompt or beam search.
    """
    body = load_json(raw, max_model_len)
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    if endpoint != CHAT and (error := check_prompt(body.get("prompt"))) is not None:
        raise error
    model_cls = _Chat if endpoint == CHAT else _Completion
    try:
        req = model_cls.model_validate(body)
    except ValidationError as exc:
        message, param = _first_error(exc)
        raise bad_request(message, param) from None
    _refuse_empty(req)
    _refuse_unsupported(req)
    if isinstance(req, _Chat):
        prompt_tokens = estimate_chat_tokens(req.messages)
        max_tokens = req.max_completion_tokens or req.max_tokens or 0
    else:
        assert req.prompt is not None  # _refuse_empty
        prompt_tokens = estimate_prompt_tokens(req.prompt)
        max_tokens = req.max_tokens or 0
    return ClientRequest(
        endpoint=endpoint,
        body=body,
        raw=raw,
        model=req.model or "",
        stream=bool(req.stream),
        prompt_tokens=prompt_tokens,
        max_tokens=max(0, max_tokens),
        routing_key=routing_key or (req.user or ""),
        priority=req.priority,
    )
