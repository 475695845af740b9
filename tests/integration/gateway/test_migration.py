"""A decode lost mid-stream: the stream continues on another decode from the tokens already
sent (request migration). The client sees one stream: every token once, in order, one
`[DONE]`, usage counting every token once; the lost attempt is released failed and nothing
stays held. Sims answer a prompt that ends in part of their own answer with the rest of it
(`pdplane.sim.tokens.resumed`), as a greedy model does, so the text is checked exactly.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from pdplane.cli import drain
from pdplane.core import tracing
from pdplane.sim.testing import RunningSims, SimHandle, expected_text
from pdplane.sim.tokens import WordTokenizer, generate, prompt_key
from tests.integration.gateway.conftest import MODEL, Stack, wait_for
from tests.integration.gateway.helpers import metric, open_request
from tests.integration.gateway.migration_helpers import MIGRATION_PROMPT as PROMPT
from tests.integration.gateway.migration_helpers import (
    errors_of,
    fleet,
    lose_the_decode_with_resumed_prefills_held,
    migrations,
    nothing_held,
    stream_events,
    stream_in_background,
    text_of,
    used_blocks,
    was_killed,
)
from tests.support.otlp import OtlpReceiver


def _chat_text(messages: list[dict[str, Any]], num_tokens: int) -> str:
    return "".join(generate(prompt_key(WordTokenizer().encode_chat(messages)), 0, num_tokens))


@pytest.mark.parametrize(
    ("path", "settings"),
    [
        ("/v1/completions", {"first_token": "prefill"}),
        ("/v1/chat/completions", {"first_token": "prefill"}),
        ("/v1/completions", {"first_token": "decode"}),
        ("/v1/chat/completions", {"first_token": "decode"}),
        ("/v1/completions", {"dispatch": "concurrent"}),
        ("/v1/chat/completions", {"dispatch": "concurrent"}),
    ],
    ids=[
        "completions",
        "chat",
        "completions-first-token-decode",
        "chat-first-token-decode",
        "completions-concurrent",
        "chat-concurrent",
    ],
)
def test_a_decode_killed_mid_stream_the_stream_continues_on_another(
    stack_factory: Callable[..., Stack], path: str, settings: dict[str, str]
) -> None:
    stack = stack_factory(**settings)
    prefill, decodes = fleet(stack, 2, itl_ms=2)
    # Whichever decode gets the stream dies at its 12th token (as SIGKILL: no deregistration);
    # the other then streams the 9 tokens left, fewer than its own 12.
    for d in decodes.handles:
        d.set_faults(kill_after_tokens=12)
    options = {"stream_options": {"include_usage": True}}
    if path == "/v1/chat/completions":
        messages = [{"role": "user", "content": PROMPT}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 22, "stream": True, **options}
        want = _chat_text(messages, 22)
        prompt_tokens = len(WordTokenizer().encode_chat(messages))
    else:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 22, "stream": True, **options}
        want = expected_text(PROMPT, 0, 22)
        prompt_tokens = len(WordTokenizer().encode(PROMPT))
    events, done = stream_events(stack.url, path, body)
    assert done and not errors_of(events), events
    assert text_of(events) == want
    usage = events[-1]["usage"]
    assert usage["prompt_tokens"] == prompt_tokens and usage["completion_tokens"] == 22, usage
    assert [e for e in events if e.get("usage")] == [events[-1]]
    assert {e["id"] for e in events} == {events[0]["id"]}
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    assert all(c.get("token_ids") is None for e in events for c in e["choices"])
    assert migrations(stack, "lost") == 1
    wait_for(lambda: stack.releases() == {"failed": 1.0, "success": 1.0}, what="releases")
    alive = [d for d in decodes.handles if not was_killed(d)]
    assert len(alive) == 1
    nothing_held(stack, [*prefill.handles, *alive])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_whose_decode_dies_before_its_first_token_is_served_by_another(
    stack_factory: Callable[..., Stack], path: str
) -> None:
    # The first token from decode: a decode cut right after its headers (completions) or its
    # role chunk (chat) sent the client no token; the stream is served whole by another.
    stack = stack_factory(first_token="decode")
    prefill, decodes = fleet(stack, 2, itl_ms=2)
    decodes[0].set_faults(fail_request_prefix="early-", fail_mode="drop", fail_after_tokens=0)
    options = {"stream_options": {"include_usage": True}}
    for i in range(4):  # decodes are picked by load, ties in turn: some land on decodes[0]
        prompt = f"{PROMPT} {i}"
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "stream": True, **options}
        if path == "/v1/chat/completions":
            messages = [{"role": "user", "content": prompt}]
            body["messages"], want = messages, _chat_text(messages, 8)
        else:
            body["prompt"], want = prompt, expected_text(prompt, 0, 8)
        events, done = stream_events(stack.url, path, body, f"early-{i}")
        assert done and not errors_of(events), events
        assert text_of(events) == want
        assert events[-1]["usage"]["completion_tokens"] == 8
        assert {e["id"] for e in events} == {events[0]["id"]}
    cut = len(decodes[0].records())
    assert cut >= 1, "no request landed on the failing decode"
    assert migrations(stack, "lost") == cut
    nothing_held(stack, [*prefill.handles, *decodes.handles])


def test_a_stream_run_again_reports_the_cached_tokens_of_the_attempt_that_served_it(
    stack_factory: Callable[..., Stack],
) -> None:
    # As a non-streamed request run again does: the attempt that served the client is the new
    # one, whose prefill found the first attempt's prompt in its prefix cache.
    stack = stack_factory(enable_prompt_tokens_details=True, first_token="decode")
    prefill, decodes = fleet(stack, 2, itl_ms=2)
    decodes[0].set_faults(fail_request_prefix="early-", fail_mode="drop", fail_after_tokens=0)
    cached = {}
    for i in range(4):  # a prompt of its own each: a first attempt has no prefix cache hit
        options = {"stream_options": {"include_usage": True}}
        prompt = f"w{i} " + " ".join([PROMPT] * 8)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True, **options}
        events, done = stream_events(stack.url, "/v1/completions", body, f"early-{i}")
        assert done and not errors_of(events), events
        cached[f"early-{i}"] = events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    cut = {r["request_id"].split("-pdp-")[0] for r in decodes[0].records()}
    assert cut, "no request landed on the failing decode"
    assert all(cached[i] > 0 for i in cut), (cached, cut)
    assert all(cached[i] == 0 for i in cached.keys() - cut), (cached, cut)
    nothing_held(stack, [*prefill.handles, *decodes.handles])


def test_a_stalled_decode_is_left_and_the_stream_continues(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(stream_idle_timeout_s=0.5)
    prefill, decodes = fleet(stack, 2, itl_ms=2)
    for d in decodes.handles:  # the stream stalls on whichever decode takes it first
        d.set_faults(fail_request_prefix="stall-", fail_mode="stall", fail_after_tokens=6)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "stream": True}
    # The resumed leg (4 tokens) ends before its own stall at token 6.
    events, done = stream_events(stack.url, "/v1/completions", body, "stall-1")
    assert done and not errors_of(events), events
    assert text_of(events) == expected_text(PROMPT, 0, 10)
    assert migrations(stack, "idle") == 1
    nothing_held(stack, [*prefill.handles, *decodes.handles])
    wait_for(lambda: stack.releases() == {"failed": 1.0, "success": 1.0}, what="releases")


def test_every_decode_dying_ends_in_one_error_after_the_limit(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(migration_limit=2)
    prefill, decodes = fleet(stack, 3, itl_ms=2)
    for d in decodes.handles:  # each leg of this request is cut after 3 tokens
        d.set_faults(fail_request_prefix="doomed-", fail_mode="drop", fail_after_tokens=3)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "stream": True}
    events, done = stream_events(stack.url, "/v1/completions", body, "doomed-1")
    assert not done
    errors = errors_of(events)
    assert len(errors) == 1 and "error" in events[-1], events
    assert "--migration-limit 2 spent" in errors[0]["message"], errors
    assert errors[0]["code"] == 502
    # The first token (prefill's) + 3 per decode, each once, in order.
    assert text_of(events[:-1]) == expected_text(PROMPT, 0, 10)
    assert migrations(stack, "lost") == 2
    assert metric(stack, 'pdplane_gateway_migration_failures_total{why="limit"}') == 1
    nothing_held(stack, [*prefill.handles, *decodes.handles])
    wait_for(lambda: stack.releases() == {"failed": 3.0}, what="three attempts failed")


def test_a_resumed_leg_given_up_on_during_its_prefill_frees_that_prefills_kv(
    stack_factory: Callable[..., Stack],
) -> None:
    # The resumed leg's prefill finished (it holds the KV) but its answer never comes, so
    # --migration-timeout-s ends the stream while the prefill call is in flight: vLLM frees
    # nothing then (the request is over on prefill); the gateway frees the KV by the transfer
    # id it gave prefill.
    stack = stack_factory(drain_grace_s=0.0, migration_timeout_s=1.0)
    prefill, decodes = fleet(stack, 2, itl_ms=50)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "stream": True}
    runner, out = stream_in_background(stack.url, "/v1/completions", body, "held-1")
    lose_the_decode_with_resumed_prefills_held(stack, prefill[0], decodes, "held-1")
    runner.join(30)
    ((events, done),) = out
    assert not done
    (error,) = errors_of(events)
    assert "not continued on another decode within --migration-timeout-s 1" in error["message"]
    nothing_held(stack, [*prefill.handles, *decodes.handles])
    resumed = [f for f in prefill[0].freed_transfers() if f["reason"] != "completed"]
    assert [f["reason"] for f in resumed] == ["aborted: failed"], resumed


def test_a_client_leaving_during_a_resumed_legs_prefill_frees_that_prefills_kv(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(drain_grace_s=0.0)
    prefill, decodes = fleet(stack, 2, itl_ms=50)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "stream": True}
    sock = open_request(stack.url, "/v1/completions", body, "held-1")
    lose_the_decode_with_resumed_prefills_held(stack, prefill[0], decodes, "held-1")
    # the first prefill's KV went to the lost decode; the resumed leg's is held, unanswered
    wait_for(lambda: len(prefill[0].held_transfers()) == 1, what="the resumed prefill's KV")
    sock.close()
    nothing_held(stack, [*prefill.handles, *decodes.handles])
    resumed = [f for f in prefill[0].freed_transfers() if f["reason"] != "completed"]
    assert [f["reason"] for f in resumed] == ["aborted: cancelled"], resumed


def test_limit_0_keeps_one_error_event(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(migration_limit=0)
    prefill, decodes = fleet(stack, 2, itl_ms=2)
    for d in decodes.handles:
        d.set_faults(fail_request_prefix="cut-", fail_mode="drop", fail_after_tokens=3)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "stream": True}
    events, done = stream_events(stack.url, "/v1/completions", body, "cut-1")
    assert not done and len(errors_of(events)) == 1 and "error" in events[-1]
    assert text_of(events[:-1]) == expected_text(PROMPT, 0, 4)
    assert len([r for d in decodes.handles for r in d.records()]) == 1  # never resumed
    nothing_held(stack, [*prefill.handles, *decodes.handles])


def _post_in_background(
    stack: Stack, body: dict[str, Any], request_id: str
) -> tuple[threading.Thread, list[httpx.Response]]:
    """POSTs `body` to /v1/completions on a started thread; its response lands in the list."""
    answers: list[httpx.Response] = []
    headers = {"X-Request-Id": request_id}
    url = f"{stack.url}/v1/completions"
    sender = threading.Thread(
        target=lambda: answers.append(httpx.post(url, json=body, headers=headers, timeout=60))
    )
    sender.start()
    return sender, answers


def _the_decode_that_took_it(decodes: RunningSims) -> SimHandle:
    wait_for(lambda: any(d.records() for d in decodes.handles), what="a decode took it")
    (victim,) = [d for d in decodes.handles if d.records()]
    return victim


def test_limit_0_a_non_streamed_request_whose_decode_dies_after_taking_it_is_not_run_again(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(migration_limit=0)
    prefill, decodes = fleet(stack, 2, itl_ms=2)
    for d in decodes.handles:
        d.set_faults(fail_request_prefix="once-", fail_mode="drop")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8}
    r = httpx.post(f"{stack.url}/v1/completions", json=body, headers={"X-Request-Id": "once-1"})
    assert r.status_code == 502, r.text
    assert "failed before answering" in r.json()["error"]["message"]
    assert "--migration-limit 0" in r.json()["error"]["message"]
    assert len([rec for d in decodes.handles for rec in d.records()]) == 1  # never run again
    nothing_held(stack, [*prefill.handles, *decodes.handles])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_limit_0_a_request_on_a_silent_decode_that_leaves_ends_with_an_error_at_once(
    stack_factory: Callable[..., Stack], stream: bool
) -> None:
    # Not moved (--migration-limit 0), but not left waiting for --upstream-timeout-s either.
    stack = stack_factory(migration_limit=0, drain_grace_s=0.0)
    prefill, decodes = fleet(stack, 2, itl_ms=2)
    for d in decodes.handles:
        d.set_faults(fail_request_prefix="frozen-", fail_mode="stall", fail_after_tokens=2)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "stream": stream}
    sender, answers = _post_in_background(stack, body, "frozen-1")
    victim = _the_decode_that_took_it(decodes)
    started = time.monotonic()
    assert drain.main([victim.instance_id, "--registry", stack.registry]) == 0
    sender.join(30)
    assert answers and time.monotonic() - started < 20, answers
    if stream:
        events = [e for e in answers[0].content.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]" and b'"error"' in events[-2], events
        assert victim.instance_id.encode() in events[-2]
    else:
        assert answers[0].status_code == 502, answers[0].text
        message = answers[0].json()["error"]["message"]
        assert victim.instance_id in message and "--migration-limit 0" in message
    assert len([rec for d in decodes.handles for rec in d.records()]) == 1  # never run again
    nothing_held(stack, [*prefill.handles, *decodes.handles])


def test_a_non_streamed_request_whose_decode_dies_is_answered_by_another(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory()
    prefill, decodes = fleet(stack, 2, itl_ms=2)
    decodes[0].set_faults(fail_request_prefix="whole-", fail_mode="drop")
    for i in range(4):  # decodes are picked by load, ties in turn: some land on decodes[0]
        prompt = f"{PROMPT} {i}"
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8}
        r = httpx.post(
            f"{stack.url}/v1/completions", json=body, headers={"X-Request-Id": f"whole-{i}"}
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected_text(prompt, 0, 8)
        assert r.json()["usage"]["completion_tokens"] == 8
    cut = len(decodes[0].records())
    assert cut >= 1, "no request landed on the failing decode"
    assert migrations(stack, "lost") == cut
    nothing_held(stack, [*prefill.handles, *decodes.handles])


def test_a_non_streamed_request_on_a_silent_decode_that_leaves_is_answered_by_another(
    stack_factory: Callable[..., Stack],
) -> None:
    # The decode takes the request and goes silent (as SIGSTOPped: its connection stays open),
    # then leaves (here drained with --drain-grace-s 0; a frozen process's lease expires): the
    # request runs again on the other decode, long before --upstream-timeout-s.
    stack = stack_factory(drain_grace_s=0.0)
    prefill, decodes = fleet(stack, 2, itl_ms=2)
    for d in decodes.handles:
        d.set_faults(fail_request_prefix="frozen-", fail_mode="stall")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8}
    sender, answers = _post_in_background(stack, body, "frozen-1")
    victim = _the_decode_that_took_it(decodes)
    (other,) = [d for d in decodes.handles if d is not victim]
    other.set_faults(fail_request_prefix="never-")
    started = time.monotonic()
    assert drain.main([victim.instance_id, "--registry", stack.registry]) == 0
    sender.join(30)
    assert answers and answers[0].status_code == 200, answers
    assert answers[0].json()["choices"][0]["text"] == expected_text(PROMPT, 0, 8)
    assert time.monotonic() - started < 20
    assert migrations(stack, "drain") == 1
    nothing_held(stack, [*prefill.handles, other])


def _run_streams(
    url: str, bodies: list[dict[str, Any]]
) -> list[tuple[list[dict[str, Any]], bool, float]]:
    """Streams `bodies` at once; per body (events, ended with [DONE], the longest wait between
    two of its events in s)."""
    out: list[Any] = [None] * len(bodies)

    def one(i: int) -> None:
        gaps: list[float] = []
        try:
            events, done = stream_events(url, "/v1/completions", bodies[i], f"s{i}-", gaps)
        except (httpx.HTTPError, AssertionError) as exc:
            events, done = [{"error": {"message": repr(exc)}}], False
        out[i] = (events, done, max(gaps, default=0.0))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_64_streams_over_4_decodes_one_killed_one_stalled_none_fails(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(embedded=True, stream_idle_timeout_s=1.0)
    prefill, decodes = fleet(stack, 4, itl_ms=10)
    decodes[0].set_faults(kill_after_tokens=20)
    decodes[1].set_faults(failure_rate=1.0, fail_mode="stall", fail_after_tokens=15)
    bodies = [
        {"model": MODEL, "prompt": f"{PROMPT} {i}", "max_tokens": 40, "stream": True}
        for i in range(64)
    ]
    results = _run_streams(stack.url, bodies)
    failed = [i for i, (events, done, _) in enumerate(results) if not done or errors_of(events)]
    assert failed == [], [results[i][0][-1] for i in failed]
    for body, (events, _, _) in zip(bodies, results, strict=True):
        assert text_of(events) == expected_text(body["prompt"], 0, 40)
    assert migrations(stack, "lost") >= 1 and migrations(stack, "idle") >= 1
    assert was_killed(decodes[0])
    nothing_held(stack, [*prefill.handles, *decodes.handles[1:]])
    # The extra latency of a migration, as the client sees it: each stream's longest wait
    # between two events, by the decode the stream started on.
    started = {d.instance_id: {r["request_id"] for r in d.records()} for d in decodes.handles}
    killed, stalled = started[decodes[0].instance_id], started[decodes[1].instance_id]

    def gaps(ids: set[str]) -> str:
        got = [g for i, (_, _, g) in enumerate(results) if any(r.startswith(f"s{i}-") for r in ids)]
        if len(got) < 2:
            return f"{len(got)} streams"
        q = statistics.quantiles(got, n=100)
        return f"{len(got)} streams, p50 {q[49] * 1000:.0f} ms, p99 {q[98] * 1000:.0f} ms"

    rest: set[str] = set()
    for d in decodes.handles[2:]:
        rest |= started[d.instance_id]
    print(
        f"longest wait between two events: streams of the killed decode {gaps(killed)}; "
        f"of the stalled decode {gaps(stalled - killed)}; "
        f"the others {gaps(rest - killed - stalled)}"
    )


def test_a_drain_moves_open_streams_after_the_grace_with_no_client_error(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(drain_grace_s=2.0)
    prefill, decodes = fleet(stack, 2, itl_ms=30)
    bodies = [
        {"model": MODEL, "prompt": f"{PROMPT} {i}", "max_tokens": 150, "stream": True}
        for i in range(32)
    ]
    out: list[Any] = []
    runner = threading.Thread(target=lambda: out.extend(_run_streams(stack.url, bodies)))
    runner.start()
    victim = decodes[0]
    wait_for(lambda: len(victim.records()) >= 8, 20, what="streams open on the drained decode")
    assert drain.main([victim.instance_id, "--registry", stack.registry]) == 0
    runner.join(120)
    failed = [events[-1] for events, done, _ in out if not done or errors_of(events)]
    assert failed == []
    for body, (events, _, _) in zip(bodies, out, strict=True):
        assert text_of(events) == expected_text(body["prompt"], 0, 150)
    assert migrations(stack, "drain") >= 1
    wait_for(lambda: used_blocks(victim) == 0, what="the drained decode idle")
    nothing_held(stack, [*prefill.handles, *decodes.handles])


def test_a_migration_is_a_span_with_the_new_legs_and_a_log_line_naming_both_decodes(
    receiver: OtlpReceiver,
    stack_factory: Callable[..., Stack],
    caplog: pytest.LogCaptureFixture,
) -> None:
    stack = stack_factory()
    _, decodes = fleet(stack, 2, itl_ms=2)
    for d in decodes.handles:
        d.set_faults(fail_request_prefix="traced-", fail_mode="drop", fail_after_tokens=4)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 7, "stream": True}
    with caplog.at_level(logging.WARNING, logger="pdplane.gateway.resume"):
        events, done = stream_events(stack.url, "/v1/completions", body, "traced-1")
    assert done and text_of(events) == expected_text(PROMPT, 0, 7)
    (line,) = [r.getMessage() for r in caplog.records if "continued on decode" in r.getMessage()]
    names = [d.instance_id for d in decodes.handles]
    first, second = sorted(names, key=line.index)  # both named: the lost one first
    assert f"decode instance {first} " in line and f"continued on decode {second}" in line
    assert "after 5 tokens (lost)" in line, line

    def exported() -> bool:
        # The client has [DONE] before the gateway ends the request's span: flush until the
        # migration's span and the request's span above it were both exported.
        tracing.flush()
        spans = list(receiver.spans)
        ids = {s.span_id for s in spans if s.name == "pdplane.request"}
        return any(s.name == "pdplane.migration" and s.parent_id in ids for s in spans)

    wait_for(exported, 10, what="the migration's and the request's spans")
    tracing.shutdown()
    spans = list(receiver.spans)
    (migration,) = [s for s in spans if s.name == "pdplane.migration"]
    assert migration.attributes["pdplane.lost_decode"] == first
    assert migration.attributes["pdplane.reason"] == "lost"
    assert migration.attributes["pdplane.tokens_sent"] == 5
    children = [s.name for s in spans if s.parent_id == migration.span_id]
    assert "pdplane.schedule" in children and "pdplane.decode_leg" in children
    request = next(s for s in spans if s.span_id == migration.parent_id)
    assert request.name == "pdplane.request"
