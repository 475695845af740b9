"""A decode lost mid-stream: the stream continues on another decode from the tokens already
sent (request migration). The client sees one stream: every token once, in order, one
`[DONE]`, usage counting every token once; the lost attempt is released failed and nothing
stays held. Sims answer a prompt that ends in part of their own answer with the rest of it
(`pdplane.sim.tokens.resumed`), as a greedy model does, so the text is checked exactly.
"""

from __future__ import annotations

import json
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
from tests.integration.gateway.test_cancellation import _open
from tests.integration.gateway.test_first_token_takeover import _metric
from tests.integration.gateway.test_tracing import receiver  # noqa: F401 (a fixture)
from tests.support.otlp import OtlpReceiver

PROMPT = "A decode instance may die in the middle of a stream"


def _stream(
    url: str,
    path: str,
    body: dict[str, Any],
    request_id: str = "",
    gaps: list[float] | None = None,
) -> tuple[list[dict[str, Any]], bool]:
    """(the parsed events, whether the stream ended with one [DONE]) of one stream; `gaps`
    gets its longest wait between two events (s)."""
    headers = {"X-Request-Id": request_id} if request_id else {}
    raw: list[bytes] = []
    gap = last = 0.0
    with httpx.stream("POST", f"{url}{path}", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line:
                now = time.perf_counter()
                gap, last = (max(gap, now - last) if last else 0.0), now
                raw.append(line.encode())
    if gaps is not None:
        gaps.append(gap)
    done = raw[-1] == b"data: [DONE]"
    assert raw.count(b"data: [DONE]") == (1 if done else 0), raw
    return [json.loads(e[6:]) for e in raw if e != b"data: [DONE]"], done


def _text(events: list[dict[str, Any]]) -> str:
    out = []
    for event in events:
        for choice in event.get("choices") or ():
            out.append(
                choice["delta"].get("content") or "" if "delta" in choice else choice["text"]
            )
    return "".join(out)


def _chat_text(messages: list[dict[str, Any]], num_tokens: int) -> str:
    return "".join(generate(prompt_key(WordTokenizer().encode_chat(messages)), 0, num_tokens))


def _errors(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["error"] for e in events if "error" in e]


def _used_blocks(sim: SimHandle) -> int:
    pool = sim.instance.state.core.pool
    return pool.num_blocks - pool.num_free


def _killed(sim: SimHandle) -> bool:
    return sim.instance._killing is not None


def _migrations(stack: Stack, reason: str) -> float:
    return _metric(stack, f'pdplane_gateway_migrations_total{{reason="{reason}"}}')


def _nothing_held(stack: Stack, sims: list[SimHandle]) -> None:
    for sim in sims:
        if sim.role == "prefill":
            wait_for(lambda s=sim: s.held_transfers() == [], what="prefill's KV freed")
        wait_for(lambda s=sim: _used_blocks(s) == 0, what=f"{sim.instance_id}'s KV blocks free")
    wait_for(lambda: stack.scheduler_inflight() == 0, what="in-flight count back to 0")
    wait_for(lambda: stack.background_tasks() == 0, what="no AbortTransfer still running")


def _fleet(stack: Stack, decodes: int, **knobs: Any) -> tuple[RunningSims, RunningSims]:
    prefill = stack.sims(["prefill"], **knobs)
    decode = stack.sims(["decode"] * decodes, **knobs)
    stack.wait_ready(prefill)
    stack.wait_ready(decode)
    return prefill, decode


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
    prefill, decodes = _fleet(stack, 2, itl_ms=2)
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
    events, done = _stream(stack.url, path, body)
    assert done and not _errors(events), events
    assert _text(events) == want
    usage = events[-1]["usage"]
    assert usage["prompt_tokens"] == prompt_tokens and usage["completion_tokens"] == 22, usage
    assert [e for e in events if e.get("usage")] == [events[-1]]
    assert {e["id"] for e in events} == {events[0]["id"]}
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    assert all(c.get("token_ids") is None for e in events for c in e["choices"])
    assert _migrations(stack, "lost") == 1
    wait_for(lambda: stack.releases() == {"failed": 1.0, "success": 1.0}, what="releases")
    alive = [d for d in decodes.handles if not _killed(d)]
    assert len(alive) == 1
    _nothing_held(stack, [*prefill.handles, *alive])


def test_a_stalled_decode_is_left_and_the_stream_continues(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(stream_idle_timeout_s=0.5)
    prefill, decodes = _fleet(stack, 2, itl_ms=2)
    for d in decodes.handles:  # the stream stalls on whichever decode takes it first
        d.set_faults(fail_request_prefix="stall-", fail_mode="stall", fail_after_tokens=6)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "stream": True}
    # The resumed leg (4 tokens) ends before its own stall at token 6.
    events, done = _stream(stack.url, "/v1/completions", body, "stall-1")
    assert done and not _errors(events), events
    assert _text(events) == expected_text(PROMPT, 0, 10)
    assert _migrations(stack, "idle") == 1
    _nothing_held(stack, [*prefill.handles, *decodes.handles])
    wait_for(lambda: stack.releases() == {"failed": 1.0, "success": 1.0}, what="releases")


def test_every_decode_dying_ends_in_one_error_after_the_limit(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(migration_limit=2)
    prefill, decodes = _fleet(stack, 3, itl_ms=2)
    for d in decodes.handles:  # each leg of this request is cut after 3 tokens
        d.set_faults(fail_request_prefix="doomed-", fail_mode="drop", fail_after_tokens=3)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "stream": True}
    events, done = _stream(stack.url, "/v1/completions", body, "doomed-1")
    assert not done
    errors = _errors(events)
    assert len(errors) == 1 and "error" in events[-1], events
    assert "--migration-limit 2 spent" in errors[0]["message"], errors
    assert errors[0]["code"] == 502
    # The first token (prefill's) + 3 per decode, each once, in order.
    assert _text(events[:-1]) == expected_text(PROMPT, 0, 10)
    assert _migrations(stack, "lost") == 2
    assert _metric(stack, 'pdplane_gateway_migration_failures_total{why="limit"}') == 1
    _nothing_held(stack, [*prefill.handles, *decodes.handles])
    wait_for(lambda: stack.releases() == {"failed": 3.0}, what="three attempts failed")


def _stream_in_background(
    url: str, path: str, body: dict[str, Any], request_id: str
) -> tuple[threading.Thread, list[tuple[list[dict[str, Any]], bool]]]:
    """`_stream` on a thread, started: (the thread, a list that gets its result)."""
    out: list[tuple[list[dict[str, Any]], bool]] = []
    runner = threading.Thread(target=lambda: out.append(_stream(url, path, body, request_id)))
    runner.start()
    return runner, out


def lose_the_decode_with_resumed_prefills_held(
    stack: Stack, prefill: SimHandle, decodes: RunningSims, request_id: str
) -> None:
    """Once the stream `request_id` has sent tokens from one of `decodes`, makes `prefill`
    finish its prefills for that request without answering them (their KV held), then drains
    that decode (with `--drain-grace-s 0`: its stream is moved at once, and its resumed legs'
    prefills hold their KV until the gateway frees it)."""

    def sent() -> bool:
        return any(r["tokens_sent"] >= 2 for d in decodes.handles for r in d.records())

    wait_for(sent, what="the stream's tokens from a decode")
    (victim,) = [d for d in decodes.handles if d.records()]
    assert victim.records()[0]["request_id"].startswith(request_id)
    prefill.set_faults(fail_request_prefix=request_id, fail_mode="stall")
    assert drain.main([victim.instance_id, "--registry", stack.registry]) == 0


def test_a_resumed_leg_given_up_on_during_its_prefill_frees_that_prefills_kv(
    stack_factory: Callable[..., Stack],
) -> None:
    # The resumed leg's prefill finished (it holds the KV) but its answer never comes, so
    # --migration-timeout-s ends the stream while the prefill call is in flight: vLLM frees
    # nothing then (the request is over on prefill); the gateway frees the KV by the transfer
    # id it gave prefill.
    stack = stack_factory(drain_grace_s=0.0, migration_timeout_s=1.0)
    prefill, decodes = _fleet(stack, 2, itl_ms=50)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "stream": True}
    runner, out = _stream_in_background(stack.url, "/v1/completions", body, "held-1")
    lose_the_decode_with_resumed_prefills_held(stack, prefill[0], decodes, "held-1")
    runner.join(30)
    ((events, done),) = out
    assert not done
    (error,) = _errors(events)
    assert "not continued on another decode within --migration-timeout-s 1" in error["message"]
    _nothing_held(stack, [*prefill.handles, *decodes.handles])
    resumed = [f for f in prefill[0].freed_transfers() if f["reason"] != "completed"]
    assert [f["reason"] for f in resumed] == ["aborted: failed"], resumed


def test_a_client_leaving_during_a_resumed_legs_prefill_frees_that_prefills_kv(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(drain_grace_s=0.0)
    prefill, decodes = _fleet(stack, 2, itl_ms=50)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "stream": True}
    sock = _open(stack.url, "/v1/completions", body, "held-1")
    lose_the_decode_with_resumed_prefills_held(stack, prefill[0], decodes, "held-1")
    # the first prefill's KV went to the lost decode; the resumed leg's is held, unanswered
    wait_for(lambda: len(prefill[0].held_transfers()) == 1, what="the resumed prefill's KV")
    sock.close()
    _nothing_held(stack, [*prefill.handles, *decodes.handles])
    resumed = [f for f in prefill[0].freed_transfers() if f["reason"] != "completed"]
    assert [f["reason"] for f in resumed] == ["aborted: cancelled"], resumed


def test_limit_0_keeps_one_error_event(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(migration_limit=0)
    prefill, decodes = _fleet(stack, 2, itl_ms=2)
    for d in decodes.handles:
        d.set_faults(fail_request_prefix="cut-", fail_mode="drop", fail_after_tokens=3)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "stream": True}
    events, done = _stream(stack.url, "/v1/completions", body, "cut-1")
    assert not done and len(_errors(events)) == 1 and "error" in events[-1]
    assert _text(events[:-1]) == expected_text(PROMPT, 0, 4)
    assert len([r for d in decodes.handles for r in d.records()]) == 1  # never resumed
    _nothing_held(stack, [*prefill.handles, *decodes.handles])


def test_a_non_streamed_request_whose_decode_dies_is_answered_by_another(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory()
    prefill, decodes = _fleet(stack, 2, itl_ms=2)
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
    assert _migrations(stack, "lost") == cut
    _nothing_held(stack, [*prefill.handles, *decodes.handles])


def _run_streams(
    url: str, bodies: list[dict[str, Any]]
) -> list[tuple[list[dict[str, Any]], bool, float]]:
    """Streams `bodies` at once; per body (events, ended with [DONE], the longest wait between
    two of its events in s)."""
    out: list[Any] = [None] * len(bodies)

    def one(i: int) -> None:
        gaps: list[float] = []
        try:
            events, done = _stream(url, "/v1/completions", bodies[i], f"s{i}-", gaps)
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
    prefill, decodes = _fleet(stack, 4, itl_ms=10)
    decodes[0].set_faults(kill_after_tokens=20)
    decodes[1].set_faults(failure_rate=1.0, fail_mode="stall", fail_after_tokens=15)
    bodies = [
        {"model": MODEL, "prompt": f"{PROMPT} {i}", "max_tokens": 40, "stream": True}
        for i in range(64)
    ]
    results = _run_streams(stack.url, bodies)
    failed = [i for i, (events, done, _) in enumerate(results) if not done or _errors(events)]
    assert failed == [], [results[i][0][-1] for i in failed]
    for body, (events, _, _) in zip(bodies, results, strict=True):
        assert _text(events) == expected_text(body["prompt"], 0, 40)
    assert _migrations(stack, "lost") >= 1 and _migrations(stack, "idle") >= 1
    assert _killed(decodes[0])
    _nothing_held(stack, [*prefill.handles, *decodes.handles[1:]])
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
    prefill, decodes = _fleet(stack, 2, itl_ms=30)
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
    failed = [events[-1] for events, done, _ in out if not done or _errors(events)]
    assert failed == []
    for body, (events, _, _) in zip(bodies, out, strict=True):
        assert _text(events) == expected_text(body["prompt"], 0, 150)
    assert _migrations(stack, "drain") >= 1
    wait_for(lambda: _used_blocks(victim) == 0, what="the drained decode idle")
    _nothing_held(stack, [*prefill.handles, *decodes.handles])


def test_a_migration_is_a_span_with_the_new_legs_and_a_log_line_naming_both_decodes(
    receiver: OtlpReceiver,  # noqa: F811 (the fixture)
    stack_factory: Callable[..., Stack],
    caplog: pytest.LogCaptureFixture,
) -> None:
    stack = stack_factory()
    _, decodes = _fleet(stack, 2, itl_ms=2)
    for d in decodes.handles:
        d.set_faults(fail_request_prefix="traced-", fail_mode="drop", fail_after_tokens=4)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 7, "stream": True}
    with caplog.at_level(logging.WARNING, logger="pdplane.gateway.resume"):
        events, done = _stream(stack.url, "/v1/completions", body, "traced-1")
    assert done and _text(events) == expected_text(PROMPT, 0, 7)
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
