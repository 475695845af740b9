"""Request migration with stop strings: the client's text is what one unbroken stream gives.

vLLM holds back a stream's last (longest stop string - 1) characters until it can tell they
start no stop string, so when a decode dies the client may lack the text of the last tokens
relayed. The gateway (with the model's tokenizer) resumes after the last token whose text
the client has, and drops from the new leg's text (and logprobs) what the client already
got; a stop string spanning the seam still ends the stream, where one instance would have
ended it. The sims
apply stop strings as vLLM does (`pdplane.sim.stops`) and use the tiny model's tokenizer,
which the gateway loads too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdplane.sim.tokens import HfTokenizer, prompt_key
from tests.integration.gateway.conftest import MODEL, Stack, wait_for
from tests.integration.gateway.migration_helpers import MIGRATION_PROMPT as PROMPT
from tests.integration.gateway.migration_helpers import (
    errors_of,
    fleet,
    logprobs_of,
    migrations,
    nothing_held,
    stream_events,
    text_of,
    was_killed,
)

KILL_AT = 12  # the decode dies after relaying this many tokens


@pytest.mark.parametrize("include", [False, True], ids=["held-back", "included"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stop_string_spanning_the_seam_ends_the_stream_as_one_instance_would(
    stack_factory: Callable[..., Stack], tiny_model: Path, path: str, include: bool
) -> None:
    tokenizer = str(tiny_model)
    stack = stack_factory(tokenizer=tokenizer)
    prefill, decodes = fleet(stack, 2, itl_ms=2, tokenizer=tokenizer)
    hf = HfTokenizer(tokenizer)
    chat = path == "/v1/chat/completions"
    messages = [{"role": "user", "content": PROMPT}]
    prompt_ids = hf.encode_chat(messages) if chat else hf.encode(PROMPT)
    _, pieces = hf.sample(prompt_key(prompt_ids), 0, 40)
    whole = "".join(pieces)
    # A stop string from inside token 11 to inside token 14: at the seam (12 tokens relayed)
    # its start is among the characters held back (or, included, already sent).
    start = len("".join(pieces[:10])) + 1
    stop = whole[start : len("".join(pieces[:14])) - 1]
    assert whole.find(stop) == start, "the stop string occurs earlier"
    want = whole[: start + len(stop)] if include else whole[:start]
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 40,
        "stream": True,
        "stop": [stop, "never seen anywhere in this answer at all"],
        "stream_options": {"include_usage": True},
    }
    if include:
        body["include_stop_str_in_output"] = True
    # logprobs too: those of tokens generated again at the seam are not repeated
    logprobs = {"logprobs": True, "top_logprobs": 1} if chat else {"logprobs": 1}
    body.update({"messages": messages, **logprobs} if chat else {"prompt": PROMPT, **logprobs})
    unbroken, _ = stream_events(stack.url, path, body)
    assert text_of(unbroken) == want
    for d in decodes.handles:
        d.set_faults(kill_after_tokens=KILL_AT)
    events, done = stream_events(stack.url, path, body)
    assert done and not errors_of(events), events
    assert text_of(events) == want
    assert logprobs_of(events) == logprobs_of(unbroken)
    assert len(logprobs_of(events)) == 14
    finishes = [
        (c["finish_reason"], c.get("stop_reason"))
        for e in events
        for c in e["choices"]
        if c["finish_reason"]
    ]
    assert finishes == [("stop", stop)]
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == 14 and usage["prompt_tokens"] == len(prompt_ids)
    assert migrations(stack, "lost") == 1
    wait_for(lambda: stack.releases() == {"failed": 1.0, "success": 2.0}, what="releases")
    alive = [d for d in decodes.handles if not was_killed(d)]
    assert len(alive) == 1
    nothing_held(stack, [*prefill.handles, *alive])


def test_without_the_models_tokenizer_a_stream_with_stop_strings_ends_with_one_error(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory()  # the sims' word tokenizer is nowhere for the gateway
    prefill, decodes = fleet(stack, 2, itl_ms=2)
    for d in decodes.handles:
        d.set_faults(kill_after_tokens=KILL_AT)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 30, "stream": True, "stop": ["zz"]}
    events, done = stream_events(stack.url, "/v1/completions", body)
    assert not done and len(errors_of(events)) == 1 and "error" in events[-1]
    assert migrations(stack, "lost") == 0
    alive = [d for d in decodes.handles if not was_killed(d)]
    nothing_held(stack, [*prefill.handles, *alive])
