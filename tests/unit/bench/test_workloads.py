"""The benchmark workloads: seeded, shaped as documented, and sized in tokens as stated."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest

from bench.routing import workloads as wl
from pdplane.sim.tokens import WordTokenizer


def test_the_same_seed_gives_the_same_workload_and_another_seed_another() -> None:
    a = wl.poisson(5, 50, wl.Lengths(100), wl.Lengths(20), seed=1)
    b = wl.poisson(5, 50, wl.Lengths(100), wl.Lengths(20), seed=1)
    c = wl.poisson(5, 50, wl.Lengths(100), wl.Lengths(20), seed=2)
    assert [(t.at, t.messages) for t in a.turns] == [(t.at, t.messages) for t in b.turns]
    assert [t.messages for t in a.turns] != [t.messages for t in c.turns]


def test_prompt_words_are_one_token_each() -> None:
    turn = wl.poisson(1, 1, wl.Lengths(500), wl.Lengths(1)).turns[0]
    assert len(WordTokenizer().encode(turn.messages[0]["content"])) == 500


def test_bursty_arrivals_vary_more_than_poisson_at_the_same_rate() -> None:
    def gaps(w: wl.Workload) -> list[float]:
        at = [t.at for t in w.turns]
        return [b - a for a, b in itertools.pairwise(at)]

    smooth = gaps(wl.poisson(10, 2000, wl.Lengths(10), wl.Lengths(1)))
    bursts = gaps(wl.bursty(10, 2000, wl.Lengths(10), wl.Lengths(1), cv=3.0))
    cv = [statistics.pstdev(g) / statistics.fmean(g) for g in (smooth, bursts)]
    assert 0.9 < cv[0] < 1.1 and cv[1] > 2.0
    assert statistics.fmean(bursts) == pytest.approx(0.1, rel=0.15)


def test_seed_case_has_1k_prompts_and_2_to_3k_answers() -> None:
    w = wl.seed_long_output(10, 200)
    assert all(900 <= t.prompt_words <= 1100 and 2000 <= t.max_tokens <= 3000 for t in w.turns)
    assert w.duration_s == pytest.approx(20, rel=0.3)


def test_shared_prefix_tenants_share_their_system_prompt() -> None:
    w = wl.shared_prefix(20, 300, tenants=4, system_tokens=200)
    systems: dict[str, set[str]] = {}
    for t in w.turns:
        systems.setdefault(t.tenant, set()).add(t.messages[0]["content"])
        assert t.user.startswith(t.tenant + "-")
    assert len(systems) == 4 and all(len(s) == 1 for s in systems.values())
    assert len({next(iter(s)) for s in systems.values()}) == 4


def test_multi_turn_sessions_follow_up_in_order() -> None:
    w = wl.multi_turn(2, 10, turns=3)
    assert len(w.first_turns) == 10
    for first in w.first_turns:
        follow = w.follow_ups(first.session)
        assert [t.turn for t in follow] == [1, 2]
        assert all(len(t.messages) == 1 and t.messages[0]["role"] == "user" for t in follow)
        assert first.messages[0]["role"] == "system"


def test_a_trace_replays_its_times_and_sizes(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    lines = [
        {"at": 10.0, "prompt": "hello there", "output_tokens": 5},
        {"timestamp": 12.5, "prompt_tokens": 30, "max_tokens": 7, "session": "s1"},
        {"at": 11.0, "messages": [{"role": "user", "content": "hi"}]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    w = wl.load_trace(path)
    assert [t.at for t in w.turns] == [0.0, 2.5, 1.0]
    assert [t.max_tokens for t in w.turns] == [5, 7, 128]
    assert w.turns[1].prompt_words == 30 and w.turns[1].user == "s1"
    path.write_text('{"at": 1}\n')
    with pytest.raises(ValueError, match=r"trace\.jsonl:1"):
        wl.load_trace(path)


def test_agent_sessions_end_before_outgrowing_the_context() -> None:
    # Each session's whole context (tool definitions, task, tool results, every answer) stays
    # within max_context words, so a model of 8192 tokens fits every turn with its template.
    w = wl.agent(2.0, 60, max_context=7500, seed=3)
    context: dict[str | None, int] = {}
    for t in w.turns:
        words = sum(len(m["content"].split()) for m in t.messages)
        context[t.session] = context.get(t.session, 0) + words + t.max_tokens
    assert max(context.values()) <= 7500
    assert len(w.turns) > len(context)  # sessions still run several turns
