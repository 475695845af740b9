"""Cheap checks of a client's JSON body, before and right after it becomes Python objects.

The gateway parses every body, so hostile ones must cost little:

- Size of the object graph. `json.loads` builds one object per array element and object member
  (a 60 MB list of 30M token ids is ~1 GB of ints, and pydantic's union validation of it was
  ~8 GB). No legitimate request has many more elements than the model has tokens of context
  (prompt ids, chat messages) plus vocabulary-sized fields (`allowed_token_ids`,
  `logit_bias`), so a body with more than `max_model_len + VALUE_SLACK` separators outside
  strings is refused before parsing. Counting `,` in the raw bytes is the fast path (C speed);
  only when that count is over the bound are the strings cut out (escaped backslashes and
  quotes removed with `bytes.replace`, then one regular expression without backtracking, all
  linear in the body) to count again, so a long text prompt full of commas is never refused.
- Nesting: `json.loads` recurses per level and raises RecursionError near 1000 levels; that is a
  400, not a 500.
- Text: the body must be UTF-8 (`json.loads` on bytes would accept encoded surrogates,
  `ED A0 80`), and a JSON escape of a lone surrogate (`"\\ud800"`) gives a `str` that cannot be
  encoded back to UTF-8 (for the instance, or to count its bytes): both are 400.
- `prompt`'s shape is checked in plain Python (one type check per element): a pydantic union of
  `str | list[str] | list[int] | list[list[int]]` collects an error per element for every branch
  it rejects, ~7x the cost of `json.loads` for a valid list of ids.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pdplane.gateway.errors import GatewayError, bad_request

__all__ = ["VALUE_SLACK", "check_prompt", "load_json"]

#: Values allowed beyond the model length: one vocabulary-sized field (`allowed_token_ids` of
#: a ~256k vocabulary). Each value costs at most ~70 bytes of objects, so the parse of an
#: accepted body is bounded by ~(max_model_len + 2^18) x 70 B besides its strings.
VALUE_SLACK = 1 << 18
#: A JSON string once its escaped backslashes and quotes are gone (possessive: no backtracking).
_STRING = re.compile(rb'"[^"]*+"')
#: A JSON escape of a UTF-16 surrogate (high or low); pairs are fine, lone ones are not.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_oversized(raw: bytes, max_values: int) -> None:
    if raw.count(b",") <= max_values:
        return
    # Escaped backslashes first, so that every `\\"` left is an escaped quote: then each `"`
    # that remains opens or closes a string.
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    separators = _STRING.sub(b"", unescaped).count(b",")
    if separators > max_values:
        raise bad_request(
            f"request has {separators + 1} JSON values, more than any request for a model of "
            f"{max_values - VALUE_SLACK} tokens can need"
        )


def _strings(value: Any) -> Any:
    """Every str (keys included) in a parsed JSON value, depth-first, without recursion."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())


def _refuse_lone_surrogates(body: Any) -> None:
    for text in _strings(body):
        try:
            text.encode()
        except UnicodeEncodeError as exc:
            raise bad_request(
                f"request body contains a lone UTF-16 surrogate ({text[exc.start]!a}): "
                "strings must be valid Unicode"
            ) from None


def load_json(raw: bytes, max_model_len: int | None = None) -> Any:
    """The parsed body of `raw`.

    Args:
        raw: the HTTP body bytes (must be UTF-8 JSON).
        max_model_len: the longest context of the served models (tokens); None = no bound on
            the number of JSON values.

    Raises:
        GatewayError(400): not UTF-8, not JSON, nested too deeply, a lone surrogate escape, or
            more JSON values than `max_model_len + VALUE_SLACK`.
    """
    if max_model_len is not None:
        _refuse_oversized(raw, max_model_len + VALUE_SLACK)
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8: {exc}") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise bad_request("request body is not valid JSON: nested too deeply") from None
    except ValueError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(raw):
        _refuse_lone_surrogates(body)
    return body


_PROMPT_TYPES = (
    "invalid value for 'prompt': expected a string, a list of strings, a list of token ids "
    "(integers in [0, 2**32)) or a list of lists of token ids"
)


#: Token ids are uint32 everywhere downstream (vLLM, the prefix block hashes).
_MAX_TOKEN_ID = 2**32 - 1


def _token_ids(items: list[Any]) -> bool:
    # `type(...) is int`: JSON true/false are bools, which are ints to isinstance.
    return all(type(i) is int for i in items) and (
        not items or (min(items) >= 0 and max(items) <= _MAX_TOKEN_ID)
    )


def check_prompt(prompt: Any) -> GatewayError | None:
    """None when a completions `prompt` is None, a str, a list of str, a list of token ids
    or a list of lists of token ids; else the 400 to answer (param "prompt")."""
    if prompt is None or isinstance(prompt, str):
        return None
    if isinstance(prompt, list):
        if not prompt:
            return None
        first = type(prompt[0])
        if first is str and all(type(p) is str for p in prompt):
            return None
        if first is int and _token_ids(prompt):
            return None
        if first is list and all(type(p) is list and _token_ids(p) for p in prompt):
            return None
    return bad_request(_PROMPT_TYPES, "prompt")
