"""Request migration of streamed `n` > 1: each unfinished choice continues on its own resumed
leg, and the client still sees one stream.

The sims stream `n` > 1 as vLLM does (one choice per chunk, with its `index`; with a seed,
choice i samples with seed + i, so the choices differ). Each test first runs the request
unbroken, then with every decode dying mid-stream, and compares per choice: text, finish,
logprobs; usage counts every token once over all choices.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdplane.sim.tokens import HfTokenizer, prompt_key
from tests.integration.gateway.conftest import MODEL, Stack, wait_for
from tests.integration.gateway.migration_helpers import MIGRATION_PROMPT as PROMPT
from tests.integration.gateway.migration_helpers import (
    errors_of,
    fleet,
    logprobs_of,
    lose_the_decode_with_resumed_prefills_held,
    migrations,
    nothing_held,
    stream_events,
    stream_in_background,
    was_killed,
)

N = 3
KILL_AT = 12  # the decode dies once it streamed this many tokens of each choice


def _choices(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per choice index: its text, its finishes [(finish_reason, stop_reason)], its logprobs."""
    out: dict[int, dict[str, Any]] = {}
    for event in events:
        for c in event.get("choices") or ():
            choice = out.setdefault(c["index"], {"text": "", "finishes": [], "events": []})
            choice["text"] += (c["delta"].get("content") or "") if "delta" in c else c["text"]
            if c["finish_reason"] is not None:
                choice["finishes"].append((c["finish_reason"], c.get("stop_reason")))
            choice["events"].append({"choices": [c]})
    for choice in out.values():
        choice["logprobs"] = logprobs_of(choice.pop("events"))
    return out


def _body(path: str, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "n": N,
        "stream": True,
        "stream_options": {"include_usage": True},
        **fields,
    }
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    return body


def _usage(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The stream's one usage block (its token counts), from its last event."""
    (usage,) = [e["usage"] for e in events if e.get("usage")]
    assert events[-1].get("usage") == usage, "the usage chunk is not the last"
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    return {k: usage[k] for k in keys}


@pytest.mark.parametrize("logprobs", [False, True], ids=["text", "logprobs"])
@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_each_choice_continues_on_its_own_leg_when_the_decode_dies(
    stack_factory: Callable[..., Stack], path: str, seed: int | None, logprobs: bool
) -> None:
    stack = stack_factory()
    prefill, decodes = fleet(stack, 2, itl_ms=2)
    fields: dict[str, Any] = {"max_tokens": 22}
    if seed is not None:
        fields["seed"] = seed  # the sims' choices then differ (seed + index, as vLLM)
    if logprobs:
        chat = path == "/v1/chat/completions"
        fields.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
    body = _body(path, **fields)
    unbroken, done = stream_events(stack.url, path, body)
    assert done
    want = _choices(unbroken)
    assert sorted(want) == list(range(N))
    assert len({c["text"] for c in want.values()}) == (N if seed is not None else 1)
    usage = _usage(unbroken)
    assert usage["completion_tokens"] == N * 22
    for d in decodes.handles:
        d.set_faults(kill_after_tokens=KILL_AT)
    events, done = stream_events(stack.url, path, body)
    assert done and not errors_of(events), events
    assert _choices(events) == want
    assert all(c["finishes"] == [("length", None)] for c in want.values())
    assert _usage(events) == usage
    assert {e["id"] for e in events} == {events[0]["id"]}
    assert all(c.get("token_ids") is None for e in events for c in e["choices"])
    if logprobs:
        assert all(len(c["logprobs"]) == 22 for c in want.values())
    assert migrations(stack, "lost") == 1  # one decode lost, whatever it carried
    alive = [d for d in decodes.handles if not was_killed(d)]
    assert len(alive) == 1
    # the survivor ran the unbroken request and one resumed leg per choice, each n=1
    legs = [r for r in alive[0].records() if isinstance(r["body"].get("prompt"), list)]
    assert len(legs) == N, legs
    assert all(r["body"].get("n") is None for r in legs)
    assert sorted(r["body"]["max_tokens"] for r in legs) == [22 - KILL_AT] * N
    if seed is not None:
        assert sorted(r["body"]["seed"] for r in legs) == [seed + i for i in range(N)]
    wait_for(lambda: stack.releases().get("failed") == 1.0, what="the lost attempt released")
    nothing_held(stack, [*prefill.handles, *alive])


def _stop_inside(pieces: list[str], first: int, last: int) -> tuple[str, int]:
    """A stop string from inside token `first` (0-based) to inside token `last`, and where
    it starts in the answer's text."""
    start = len("".join(pieces[:first])) + 1
    return "".join(pieces)[start : len("".join(pieces[: last + 1])) - 1], start


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stop_strings_per_choice_and_a_finished_choice_is_not_resumed(
    stack_factory: Callable[..., Stack], tiny_model: Path, path: str
) -> None:
    tokenizer = str(tiny_model)
    stack = stack_factory(tokenizer=tokenizer)
    prefill, decodes = fleet(stack, 2, itl_ms=2, tokenizer=tokenizer)
    hf = HfTokenizer(tokenizer)
    chat = path == "/v1/chat/completions"
    messages = [{"role": "user", "content": PROMPT}]
    prompt_ids = hf.encode_chat(messages) if chat else hf.encode(PROMPT)
    # 18 tokens: the survivor streams fewer than KILL_AT of any choice (it would die too)
    seed, most = 3, 18
    pieces = [hf.sample(prompt_key(prompt_ids), seed + i, most)[1] for i in range(N)]
    answers = ["".join(p) for p in pieces]
    # choice 0: a stop string spanning the seam (tokens 10..13 around the 12th);
    # choice 1: one that ends it at its 5th token, before the decode dies.
    across, at0 = _stop_inside(pieces[0], 10, 13)
    early, at1 = _stop_inside(pieces[1], 2, 4)
    for stop, owner, at in ((across, 0, at0), (early, 1, at1)):
        for i, answer in enumerate(answers):
            assert answer.find(stop) == (at if i == owner else -1), (stop, i)
    body = _body(
        path,
        max_tokens=most,
        seed=seed,
        stop=[across, early],
        **({"logprobs": True, "top_logprobs": 1} if chat else {"logprobs": 1}),
    )
    unbroken, done = stream_events(stack.url, path, body)
    assert done
    want = _choices(unbroken)
    assert want[0]["text"] == answers[0][:at0] and want[0]["finishes"] == [("stop", across)]
    assert want[1]["text"] == answers[1][:at1] and want[1]["finishes"] == [("stop", early)]
    assert want[2]["text"] == answers[2] and want[2]["finishes"] == [("length", None)]
    usage = _usage(unbroken)
    for d in decodes.handles:
        d.set_faults(kill_after_tokens=KILL_AT)
    events, done = stream_events(stack.url, path, body)
    assert done and not errors_of(events), events
    assert _choices(events) == want
    assert _usage(events) == usage
    alive = [d for d in decodes.handles if not was_killed(d)]
    assert len(alive) == 1
    legs = [r for r in alive[0].records() if isinstance(r["body"].get("prompt"), list)]
    # choice 1 had finished: only choices 0 and 2 were resumed
    assert sorted(r["body"]["seed"] for r in legs) == [seed, seed + 2], legs
    assert migrations(stack, "lost") == 1
    nothing_held(stack, [*prefill.handles, *alive])


def test_a_choice_whose_every_leg_dies_ends_the_stream_with_one_error(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(migration_limit=2)
    prefill, decodes = fleet(stack, 3, itl_ms=2)
    for d in decodes.handles:  # every leg of this request (its choices' too) is cut
        d.set_faults(fail_request_prefix="doomed-", fail_mode="drop", fail_after_tokens=3)
    body = _body("/v1/completions", max_tokens=40)
    events, done = stream_events(stack.url, "/v1/completions", body, "doomed-1")
    assert not done
    errors = errors_of(events)
    assert len(errors) == 1 and "error" in events[-1], events
    assert "--migration-limit 2 spent" in errors[0]["message"], errors
    assert migrations(stack, "lost") == 2
    nothing_held(stack, [*prefill.handles, *decodes.handles])


def test_choices_given_up_on_during_their_prefills_free_those_prefills_kv(
    stack_factory: Callable[..., Stack],
) -> None:
    # Every choice's resumed leg is in its prefill call (prefill finished, its answer never
    # comes) when --migration-timeout-s ends the stream: the first choice out of time ends it
    # with its error, the others are closed mid-prefill; each prefill's KV is freed.
    stack = stack_factory(drain_grace_s=0.0, migration_timeout_s=1.0)
    prefill, decodes = fleet(stack, 2, itl_ms=50)
    body = _body("/v1/completions", max_tokens=200)
    runner, out = stream_in_background(stack.url, "/v1/completions", body, "held-1")
    lose_the_decode_with_resumed_prefills_held(stack, prefill[0], decodes, "held-1")
    runner.join(30)
    ((events, done),) = out
    assert not done
    (error,) = errors_of(events)
    assert "error" in events[-1] and "--migration-timeout-s 1" in error["message"], events
    nothing_held(stack, [*prefill.handles, *decodes.handles])
    resumed = [f for f in prefill[0].freed_transfers() if f["reason"] != "completed"]
    assert len(resumed) == N and all(f["reason"].startswith("aborted") for f in resumed), resumed


def test_a_non_streamed_n_above_1_whose_decode_dies_runs_again_on_another_pair(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory()
    prefill, decodes = fleet(stack, 2, itl_ms=2)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "n": N, "seed": 1}
    whole = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30)
    assert whole.status_code == 200, whole.text
    want = [c["text"] for c in whole.json()["choices"]]
    assert len(set(want)) == N
    decodes[0].set_faults(fail_request_prefix="whole-", fail_mode="drop")
    for i in range(4):  # decodes are picked by load, ties in turn: some land on decodes[0]
        r = httpx.post(
            f"{stack.url}/v1/completions",
            json=body,
            headers={"X-Request-Id": f"whole-{i}"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        answer = r.json()
        assert [c["text"] for c in sorted(answer["choices"], key=lambda c: c["index"])] == want
        assert answer["usage"]["completion_tokens"] == N * 8
    cut = len([r for r in decodes[0].records() if r["request_id"].startswith("whole-")])
    assert cut >= 1, "no request landed on the failing decode"
    assert migrations(stack, "lost") == cut
    nothing_held(stack, [*prefill.handles, *decodes.handles])
