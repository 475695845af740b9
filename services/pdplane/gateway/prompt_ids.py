"""Exact prompt token ids at the gateway, with the model's own tokenizer (`--tokenizer`).

The prefix index matches the token ids an engine will compute, so the gateway reproduces what
vLLM 0.32's OpenAI server does with the same Hugging Face tokenizer (`transformers`, as vLLM
loads it):

- completions text: `tokenizer.encode(prompt, add_special_tokens=body.add_special_tokens)`
  (default True: BOS etc. as the tokenizer's config says);
- completions token ids (`[1, 2]` or `[[1, 2]]`): as given;
- chat: `apply_chat_template(messages, add_generation_prompt=..., continue_final_message=...,
  tokenize=True, return_dict=False)` with the tokenizer's chat template (vLLM's defaults:
  add_generation_prompt=True, continue_final_message=False).

Requests whose ids vLLM derives in ways not reproduced here give None ("unknown"; the request
is routed by its estimated length only, never refused for it): `prompt_embeds`,
`truncate_prompt_tokens`, chat messages other than plain `{"role", "content": str}` (content
parts, tool calls, the `developer` role vLLM rewrites), `tools`, `documents`,
`chat_template`, `chat_template_kwargs` or `reasoning_effort`, or a tokenizer without a chat
template.

Bounded work (vLLM's own rule, `vllm.renderers.params.TokenizeParams._text_len_check`): a text
longer than max_model_len x the vocabulary's longest token (characters) cannot fit and is
refused before it is tokenized; ids of max_model_len or more are refused as vLLM refuses them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pdplane.core.prefix_hash import block_hashes
from pdplane.gateway.errors import bad_request
from pdplane.gateway.validation import CHAT, ClientRequest

__all__ = [
    "OFFLOAD_CHARS",
    "PromptTokenizer",
    "TokenizerSet",
    "Tokenizers",
    "exact_prompt",
    "exact_prompt_async",
    "given_ids",
    "load_tokenizers",
    "prompt_ids",
]

log = logging.getLogger(__name__)

_PLAIN_MESSAGE_KEYS = frozenset({"role", "content"})
#: Chat fields that change vLLM's rendering in ways this module does not reproduce.
_CHAT_UNKNOWN_FIELDS = (
    "tools",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "reasoning_effort",
    "prompt_embeds",
)
_COMPLETION_UNKNOWN_FIELDS = ("prompt_embeds", "truncate_prompt_tokens")


class PromptTokenizer:
    """One model's Hugging Face tokenizer, loaded from a local directory.

    Args:
        path: directory with `tokenizer.json` / `tokenizer_config.json` (the model folder, or
            a tokenizer an instance published, `pdplane.gateway.fleet_tokenizers`).
        chat_template: the chat template the instances render with when it overrides the
            tokenizer's own (Jinja text; `vllm serve --chat-template`); None = the tokenizer's.
        chat_template_kwargs: variables every chat render gets (`vllm serve
            --default-chat-template-kwargs`).
        use_fast: False loads the slow tokenizer (vLLM's `--tokenizer-mode slow`).
        trust_remote_code: lets the directory's own tokenizer code run (only for a folder the
            operator names; never for one an instance published).

    A chat template renders in transformers' sandboxed Jinja environment.

    Raises:
        OSError / ValueError: the directory is missing or holds no loadable tokenizer.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        use_fast: bool = True,
        trust_remote_code: bool = False,
    ) -> None:
        from transformers import AutoTokenizer  # heavy import: only when a tokenizer is used

        self.path = str(path)
        if not Path(path).is_dir():
            raise OSError(f"tokenizer directory {self.path!r} does not exist")
        self._tok: Any = AutoTokenizer.from_pretrained(
            self.path,
            trust_remote_code=trust_remote_code,
            use_fast=use_fast,
            local_files_only=True,  # a folder: never a download
        )
        if chat_template:
            self._tok.chat_template = chat_template
        self._template_kwargs = dict(chat_template_kwargs or {})
        #: Characters of the vocabulary's longest token: a text of n characters has at least
        #: n / this many tokens (vLLM's `max_chars_per_token`).
        self.max_chars_per_token = max(1, max(len(t) for t in self._tok.get_vocab()))
        self.has_chat_template = bool(getattr(self._tok, "chat_template", None))
        # A fast tokenizer's Rust `tokenizers.Tokenizer`: called directly, the same ids as
        # `encode` for ~20 % less CPU per prompt (transformers' argument handling skipped).
        self._backend: Any = getattr(self._tok, "backend_tokenizer", None)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._backend is not None:
            ids: list[int] = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
            return ids
        encoded: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return encoded

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`, special tokens kept unless `skip_special_tokens`; bytes that end
        inside a UTF-8 character decode to U+FFFD. Ids the vocabulary lacks decode to
        nothing."""
        if self._backend is not None:
            text: str = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
            return text
        out: str = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return out

    def _check_chars(self, text_chars: int, max_model_len: int) -> None:
        limit = max_model_len * self.max_chars_per_token
        if max_model_len and text_chars > limit:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"your prompt contains {text_chars} characters (more than {limit} characters, "
                f"which is the upper bound for {max_model_len} input tokens). Please reduce "
                "the length of the input prompt.",
                "input_text",
            )

    def completion_ids(self, body: Mapping[str, Any], max_model_len: int) -> list[int] | None:
        """The ids vLLM computes for a validated completions `body` (one prompt); None when
        not reproduced (module doc). Raises GatewayError(400) for a prompt that cannot fit
        `max_model_len` tokens (0 = no bound)."""
        if any(body.get(k) is not None for k in _COMPLETION_UNKNOWN_FIELDS):
            return None
        prompt = _single_prompt(body)
        if isinstance(prompt, list):
            return given_ids(body)
        if not isinstance(prompt, str):
            return None
        self._check_chars(len(prompt), max_model_len)
        add_special = body.get("add_special_tokens", True)
        return self._encode(prompt, add_special is not False)

    def chat_ids(self, body: Mapping[str, Any], max_model_len: int) -> list[int] | None:
        """The ids vLLM computes for a validated chat `body` through the chat template; None
        when not reproduced (module doc). Raises GatewayError(400) as `completion_ids`."""
        if not self.has_chat_template or any(body.get(k) is not None for k in _CHAT_UNKNOWN_FIELDS):
            return None
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        chars = 0
        for m in messages:
            if (
                not isinstance(m, dict)
                or not m.keys() <= _PLAIN_MESSAGE_KEYS
                or not isinstance(m.get("content"), str)
                or m.get("role") not in ("system", "user", "assistant")
            ):
                return None
            chars += len(m["content"])
        self._check_chars(chars, max_model_len)
        # As vLLM does: the template renders text, which is tokenized without special tokens
        # (the template wrote them).
        text: str = self._tok.apply_chat_template(
            messages,
            add_generation_prompt=body.get("add_generation_prompt", True) is not False,
            continue_final_message=body.get("continue_final_message") is True,
            tokenize=False,
            **self._template_kwargs,
        )
        return self._encode(text, False)


class Tokenizers(Protocol):
    """Where the request path finds a model's tokenizer (`TokenizerSet`, or the fleet's:
    `pdplane.gateway.fleet_tokenizers.FleetTokenizers`)."""

    def get(self, model: str) -> PromptTokenizer | None:
        """The tokenizer of `model`; None = its prompts' ids are not known."""


@dataclass(frozen=True, slots=True)
class TokenizerSet:
    """The tokenizers of the served models: `default` for any model not in `by_model`.

    `described` is the one-line state for logs and /health, e.g. "tiny: /models/tiny".
    """

    by_model: Mapping[str, PromptTokenizer]
    default: PromptTokenizer | None = None

    def get(self, model: str) -> PromptTokenizer | None:
        """The tokenizer of `model`, None when it has none (estimated lengths only)."""
        return self.by_model.get(model, self.default)

    @property
    def exact(self) -> bool:
        """Whether any model has a tokenizer (exact prompt ids and prefix hashes)."""
        return self.default is not None or bool(self.by_model)

    def describe(self) -> dict[str, str]:
        """model name ("*" = any other model) -> tokenizer directory."""
        out = {name: tok.path for name, tok in sorted(self.by_model.items())}
        if self.default is not None:
            out["*"] = self.default.path
        return out


def _parse(spec: str) -> list[tuple[str, str]]:
    entries = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, path = item.partition("=")
        entries.append((name.strip(), path.strip()) if sep else ("", item))
    return entries


def load_tokenizers(spec: str | None, trust_remote_code: bool = False) -> TokenizerSet:
    """The tokenizers named by `--tokenizer`: "DIR" (every model) or "MODEL=DIR,..." (several);
    `trust_remote_code` lets them run the tokenizer code of their folders (vLLM's
    `--trust-remote-code`).

    A directory that does not load is logged (once, here) and left out: the gateway then
    takes that model's tokenizer from the fleet. Never raises.
    """
    by_model: dict[str, PromptTokenizer] = {}
    default: PromptTokenizer | None = None
    for name, path in _parse(spec or ""):
        try:
            tok = PromptTokenizer(path, trust_remote_code=trust_remote_code)
        except Exception as exc:  # any load failure means "no tokenizer"
            log.warning(
                "tokenizer %r%s not loaded (%s): the fleet's is used",
                path,
                f" for model {name!r}" if name else "",
                exc,
            )
            continue
        if name:
            by_model[name] = tok
        else:
            default = tok
    tokenizers = TokenizerSet(by_model, default)
    if tokenizers.exact:
        log.info("--tokenizer: %s", tokenizers.describe())
    return tokenizers


def _single_prompt(body: Mapping[str, Any]) -> Any:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return prompt[0]
    return prompt


def given_ids(body: Mapping[str, Any]) -> list[int] | None:
    """The token ids a validated completions `body` gives as its prompt (`[1, 2]` or
    `[[1, 2]]`), which vLLM uses as they are: no tokenizer needed. None for a text prompt,
    several prompts, or fields that change the ids (module doc)."""
    if any(body.get(k) is not None for k in _COMPLETION_UNKNOWN_FIELDS):
        return None
    prompt = _single_prompt(body)
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return prompt
    return None


def prompt_ids(
    tokenizer: PromptTokenizer | None, chat: bool, body: Mapping[str, Any], max_model_len: int
) -> Sequence[int] | None:
    """`chat_ids` or `completion_ids` of `body`; without a tokenizer, the ids a completions
    prompt gives (`given_ids`), None otherwise."""
    if tokenizer is None:
        return None if chat else given_ids(body)
    if chat:
        return tokenizer.chat_ids(body, max_model_len)
    return tokenizer.completion_ids(body, max_model_len)


#: Prompts of more characters than this are tokenized on a worker thread, so a long prompt
#: does not stall the event loop (measured: ~1 us per character on the tiny model's BPE;
#: 4096 characters ~0.5 ms inline, about the cost of the thread hop itself many times over).
OFFLOAD_CHARS = 4096


def _chars(body: Mapping[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return len(prompt[0])
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(
            len(m["content"])
            for m in messages
            if isinstance(m, dict) and isinstance(m.get("content"), str)
        )
    return 0


def exact_prompt(
    tokenizer: PromptTokenizer | None,
    req: ClientRequest,
    max_model_len: int,
    block_sizes: Sequence[int],
) -> ClientRequest:
    """`req` with its exact `prompt_tokens` and `prefix_hashes` (one entry per block size, from
    `pdplane.core.prefix_hash.block_hashes`); `req` unchanged when its ids are not reproduced
    (without `tokenizer`: unless its prompt is token ids).

    Raises GatewayError(400): the prompt has `max_model_len` tokens or more (vLLM's message),
    or cannot fit by its length in characters.
    """
    ids = prompt_ids(tokenizer, req.endpoint == CHAT, req.body, max_model_len)
    if ids is None:
        return req
    if max_model_len and len(ids) >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {len(ids)} input tokens, which exceeds this limit even without "
            "any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
        )
    try:
        hashes = {bs: block_hashes(ids, bs) for bs in block_sizes}
        # Kept for the request's life (a prefix warm sends a part of them): 4 bytes a token,
        # where a list of ints takes ~36 (~1 MB for a 32k-token prompt).
        kept = array("I", ids)
    except (ValueError, OverflowError):
        return req  # a token id beyond uint32: vLLM refuses it, the estimate routes it there
    return dataclasses.replace(
        req, prompt_tokens=max(1, len(ids)), prefix_hashes=hashes, prompt_ids=kept
    )


async def exact_prompt_async(
    tokenizer: PromptTokenizer | None,
    req: ClientRequest,
    max_model_len: int,
    block_sizes: Sequence[int],
) -> ClientRequest:
    """`exact_prompt`, on a worker thread when the prompt has more than OFFLOAD_CHARS
    characters."""
    if _chars(req.body) > OFFLOAD_CHARS:
        return await asyncio.to_thread(exact_prompt, tokenizer, req, max_model_len, block_sizes)
    return exact_prompt(tokenizer, req, max_model_len, block_sizes)
