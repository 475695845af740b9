"""Request migration with logprobs: the stream resumed on another decode keeps giving them in
the client's shape, the same ones an unbroken stream gives (the sims' logprobs depend on the
token only). Chat continues on a completions leg, whose logprobs become chat's; completions'
`text_offset` keeps counting from the start of the answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.integration.gateway.conftest import MODEL, Stack
from tests.integration.gateway.migration_helpers import MIGRATION_PROMPT as PROMPT
from tests.integration.gateway.migration_helpers import (
    errors_of,
    fleet,
    logprobs_of,
    migrations,
    nothing_held,
    stream_events,
    text_of,
)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_logprobs_continue_across_the_seam_as_one_stream_gives_them(
    stack_factory: Callable[..., Stack], path: str
) -> None:
    stack = stack_factory()
    prefill, decodes = fleet(stack, 2, itl_ms=2)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 16, "stream": True}
    if path == "/v1/chat/completions":
        body.update(messages=[{"role": "user", "content": PROMPT}], logprobs=True, top_logprobs=2)
    else:
        body.update(prompt=PROMPT, logprobs=2)
    unbroken, done = stream_events(stack.url, path, body)
    assert done and len(logprobs_of(unbroken)) == 16
    for d in decodes.handles:
        d.set_faults(kill_after_tokens=10)
    events, done = stream_events(stack.url, path, body)
    assert done and not errors_of(events), events
    assert migrations(stack, "lost") == 1
    assert text_of(events) == text_of(unbroken)
    assert logprobs_of(events) == logprobs_of(unbroken)
    nothing_held(
        stack, [*prefill.handles, *(d for d in decodes.handles if d.instance._killing is None)]
    )
