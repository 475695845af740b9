"""Seeded workloads for the routing and capacity benchmarks (and their tests).

A workload is a list of `Turn`s: when to send (seconds of modelled time from the start), the
chat messages of the request before any earlier answer is known, and how many tokens to
generate. Turns of one `session` after the first are follow-ups: they are sent `after_s`
seconds after the previous turn of the session finished, with the previous answers spliced in
(multi-turn chat). Prompt text is made of words that are one token each for `pdplane sim`'s
default tokenizer and for the tiny model's tokenizer, so a prompt of N "tokens" is N words.

Generators (every one takes a `seed`; the same arguments give the same workload):
- `poisson` / `bursty`: independent requests at a rate (bursty: gamma inter-arrival times with
  a coefficient of variation > 1), prompt and output lengths from `Lengths` distributions;
- `seed_long_output`: the seed's failing case (about 1k-token prompts, 2-3k-token answers,
  10 req/s);
- `shared_prefix`: T tenants, each with a long system prompt and many users asking short
  questions (multi-tenant shared prefixes);
- `multi_turn`: sessions of several turns, each turn appending the previous answer;
- `tenant_mix`: tenants whose system prompts differ in length, Zipf-skewed popularity, with
  a share of requests over shared documents and a share of cold unique prompts (the mix
  `kv_aware` was not tuned on);
- `rag`: a short system prompt, then one to three documents of a shared set (Zipf-skewed)
  and a question: prefixes shared as far as the first document;
- `cold`: unique prompts only (caching cannot help);
- `long_output`: few tenants with shared system prompts and long answers (decode-bound);
- `agent`: agent sessions over shared tool-definition prefixes, each turn appending a tool
  result (contexts grow fast, think times short);
- `hot_prefix`: one long system prompt shared by every request;
- `load_trace`: replay of a JSONL trace (`{"at": s, "prompt": text | "messages": [...] |
  "prompt_tokens": N, "output_tokens" | "max_tokens": N, "session": id}` per line).

`FAMILY` names the routing scorecard's workloads (`bench/routing/scorecard.py`): a training set the
`kv_aware` policy's parameters were chosen on and a held-out set checked last, each a factory
`(rate, duration_s, seed) -> Workload` where `rate` is requests per second (sessions x turns).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdplane.models import tiny
from pdplane.plan.workload import Lengths, arrival_times

__all__ = [
    "FAMILY",
    "HELD_OUT",
    "TRAIN",
    "Lengths",
    "Turn",
    "Workload",
    "agent",
    "bursty",
    "cold",
    "hot_prefix",
    "load_trace",
    "long_output",
    "multi_turn",
    "poisson",
    "rag",
    "seed_long_output",
    "shared_prefix",
    "tenant_mix",
    "trending_docs",
]

_QUESTION = Lengths(100, "uniform", 50, 150)
_FIRST = Lengths(400, "uniform", 300, 500)
_FOLLOW = Lengths(80, "uniform", 40, 120)
_OSL_SHORT = Lengths(150, "uniform", 100, 200)
_OSL_SEED = Lengths(2500, "uniform", 2000, 3000)
_MIX_SYSTEM = Lengths(1500, "lognormal", 200, 5000, 0.8)
_MIX_DOC = Lengths(1500, "uniform", 1000, 2000)
_COLD = Lengths(2000, "uniform", 1000, 3000)
_MIX_QUESTION = Lengths(120, "uniform", 50, 200)
_OSL_CHAT = Lengths(170, "uniform", 50, 300)
_RAG_DOC = Lengths(1200, "uniform", 800, 1600)
_RAG_QUESTION = Lengths(60, "uniform", 30, 100)
_AGENT_TURNS = Lengths(6, "uniform", 4, 8)
_LONG_ANSWER = Lengths(1200, "uniform", 800, 1600)
_TASK = Lengths(300, "uniform", 100, 500)
_TOOL_RESULT = Lengths(500, "uniform", 200, 800)
_OSL_AGENT = Lengths(200, "uniform", 100, 300)
_TRENDING_DOC = Lengths(3500, "uniform", 2000, 5000)

# The tiny model's corpus words: each is one token for its tokenizer (with the leading space)
# and for the simulator's word tokenizer, so both count a prompt of N words as N tokens.
_WORDS: tuple[str, ...] = tuple(tiny._WORDS)


@dataclass(slots=True)
class Turn:
    """One request of a workload.

    Attributes:
        at: send time (modelled s from the start) of a session's first turn; for a follow-up,
            the think time after the previous turn of its session finished.
        messages: the chat messages before earlier answers are spliced in (a follow-up holds
            only its new user message; the runner prepends the history).
        max_tokens: tokens to generate.
        session: conversation id ("" = a one-off request); follow-ups share it.
        user: the OpenAI `user` field (end-user id; consistent_hash routes by it).
        tenant: which tenant's system prompt it carries ("" = none).
        turn: 0 for a session's first request, k for its k-th follow-up.
    """

    at: float
    messages: list[dict[str, str]]
    max_tokens: int
    session: str = ""
    user: str = ""
    tenant: str = ""
    turn: int = 0

    @property
    def prompt_words(self) -> int:
        return sum(len(m["content"].split()) for m in self.messages)


@dataclass(slots=True)
class Workload:
    """A named, seeded list of turns (follow-ups keep their session's order)."""

    name: str
    turns: list[Turn]
    description: str = ""
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def first_turns(self) -> list[Turn]:
        return sorted((t for t in self.turns if t.turn == 0), key=lambda t: t.at)

    def follow_ups(self, session: str) -> list[Turn]:
        return sorted(
            (t for t in self.turns if t.session == session and t.turn), key=lambda t: t.turn
        )

    @property
    def duration_s(self) -> float:
        return max((t.at for t in self.turns if t.turn == 0), default=0.0)


def _words(rng: random.Random, count: int) -> str:
    """`count` random words, one token each (see `_WORDS`; ~5.6 bytes a token with the space,
    so a gateway estimating 4 bytes a token overestimates prompts by ~1.4x)."""
    return " ".join(rng.choices(_WORDS, k=count))


def _arrivals(rng: random.Random, rate: float, count: int, cv: float = 1.0) -> list[float]:
    return arrival_times(rng, rate, count, cv)


def poisson(
    rate: float, count: int, isl: Lengths, osl: Lengths, *, seed: int = 0, cv: float = 1.0
) -> Workload:
    """Independent requests at `rate` per second (Poisson; `cv` > 1 makes them bursty)."""
    rng = random.Random(seed)
    turns = [
        Turn(at, [{"role": "user", "content": _words(rng, isl.draw(rng))}], osl.draw(rng))
        for at in _arrivals(rng, rate, count, cv)
    ]
    name = "poisson" if cv == 1.0 else "bursty"
    return Workload(
        name,
        turns,
        f"{count} requests at {rate}/s, cv {cv}",
        {"rate": rate, "count": count, "isl": isl.mean, "osl": osl.mean, "cv": cv},
    )


def bursty(
    rate: float, count: int, isl: Lengths, osl: Lengths, *, seed: int = 0, cv: float = 3.0
) -> Workload:
    """`poisson` with gamma inter-arrivals of coefficient of variation `cv` (bursts)."""
    return poisson(rate, count, isl, osl, seed=seed, cv=cv)


def seed_long_output(
    rate: float = 10.0,
    count: int = 2000,
    *,
    osl: Lengths = _OSL_SEED,
    seed: int = 0,
) -> Workload:
    """The seed's case: ~1k-token prompts (900-1100), 2-3k-token answers, `rate` req/s."""
    w = poisson(rate, count, Lengths(1000, "uniform", 900, 1100), osl, seed=seed)
    w.name = "seed-long-output"
    w.description = f"seed 1P7D case: ~1k prompt, 2-3k answer, {rate}/s, {count} requests"
    return w


def shared_prefix(
    rate: float,
    count: int,
    *,
    tenants: int = 8,
    system_tokens: int = 2000,
    users_per_tenant: int = 50,
    question: Lengths = _QUESTION,
    osl: Lengths = _QUESTION,
    seed: int = 0,
) -> Workload:
    """T tenants, each with a long system prompt; requests from their users at `rate`/s."""
    rng = random.Random(seed)
    systems = [_words(random.Random(f"tenant-{seed}-{t}"), system_tokens) for t in range(tenants)]
    turns = []
    for at in _arrivals(rng, rate, count):
        t = rng.randrange(tenants)
        messages = [
            {"role": "system", "content": systems[t]},
            {"role": "user", "content": _words(rng, question.draw(rng))},
        ]
        user = f"t{t}-u{rng.randrange(users_per_tenant)}"
        turns.append(Turn(at, messages, osl.draw(rng), user=user, tenant=f"t{t}"))
    return Workload(
        "shared-prefix",
        turns,
        f"{tenants} tenants x {system_tokens}-token system prompts, {rate}/s",
        {"rate": rate, "count": count, "tenants": tenants, "system_tokens": system_tokens},
    )


def multi_turn(
    rate: float,
    sessions: int,
    *,
    turns: int = 5,
    system_tokens: int = 200,
    first: Lengths = _FIRST,
    follow: Lengths = _FOLLOW,
    osl: Lengths = _OSL_SHORT,
    think_s: float = 2.0,
    seed: int = 0,
) -> Workload:
    """`sessions` conversations starting at `rate`/s, each `turns` turns long; every turn is
    sent `think_s` (exponential) after the previous answer and carries the whole history."""
    rng = random.Random(seed)
    out = []
    for s, at in enumerate(_arrivals(rng, rate, sessions)):
        sid = f"s{s}"
        system = {"role": "system", "content": _words(rng, system_tokens)}
        msg = {"role": "user", "content": _words(rng, first.draw(rng))}
        out.append(Turn(at, [system, msg], osl.draw(rng), session=sid, user=sid))
        for k in range(1, turns):
            msg = {"role": "user", "content": _words(rng, follow.draw(rng))}
            think = rng.expovariate(1 / think_s)
            out.append(Turn(think, [msg], osl.draw(rng), session=sid, user=sid, turn=k))
    return Workload(
        "multi-turn",
        out,
        f"{sessions} sessions x {turns} turns, {rate} sessions/s",
        {"rate": rate, "sessions": sessions, "turns": turns},
    )


def _zipf(rng: random.Random, n: int, s: float) -> Callable[[], int]:
    """A draw of 0..n-1 with P(k) proportional to 1 / (k + 1) ** s (rank 0 the most popular)."""
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    ranks = list(range(n))
    return lambda: rng.choices(ranks, weights)[0]


def _texts(tag: str, seed: int, lengths: list[int]) -> list[str]:
    """Shared texts (system prompts, documents) of the given lengths, seeded by `tag`."""
    return [_words(random.Random(f"{tag}-{seed}-{k}"), n) for k, n in enumerate(lengths)]


def tenant_mix(
    rate: float,
    count: int,
    *,
    tenants: int = 100,
    zipf: float = 1.1,
    system: Lengths = _MIX_SYSTEM,
    documents: int = 200,
    document: Lengths = _MIX_DOC,
    rag_share: float = 0.3,
    cold_share: float = 0.2,
    cold: Lengths = _COLD,
    question: Lengths = _MIX_QUESTION,
    osl: Lengths = _OSL_CHAT,
    cv: float = 1.0,
    seed: int = 0,
) -> Workload:
    """Tenants' system prompts of mixed lengths (lognormal) picked by Zipf popularity, a
    `rag_share` of requests adding a shared document (Zipf too) after the tenant's prompt,
    and a `cold_share` of unique prompts; `cv` > 1 makes arrivals bursty."""
    rng = random.Random(seed)
    srng = random.Random(f"mix-sizes-{seed}")
    systems = _texts("mix-tenant", seed, [system.draw(srng) for _ in range(tenants)])
    docs = _texts("mix-doc", seed, [document.draw(srng) for _ in range(documents)])
    tenant, doc = _zipf(rng, tenants, zipf), _zipf(rng, documents, zipf)
    turns = []
    for at in _arrivals(rng, rate, count, cv):
        u = rng.random()
        if u < cold_share:
            messages = [{"role": "user", "content": _words(rng, cold.draw(rng))}]
            turns.append(Turn(at, messages, osl.draw(rng)))
            continue
        t = tenant()
        content = _words(rng, question.draw(rng))
        if u < cold_share + rag_share:
            content = docs[doc()] + " " + content
        messages = [{"role": "system", "content": systems[t]}, {"role": "user", "content": content}]
        turns.append(Turn(at, messages, osl.draw(rng), user=f"t{t}", tenant=f"t{t}"))
    return Workload(
        "tenant-mix",
        turns,
        f"{tenants} tenants (Zipf {zipf}), {rag_share:.0%} with a document, {cold_share:.0%} cold",
        {"rate": rate, "count": count, "tenants": tenants, "cv": cv},
    )


def rag(
    rate: float,
    count: int,
    *,
    documents: int = 400,
    zipf: float = 0.9,
    document: Lengths = _RAG_DOC,
    system_tokens: int = 200,
    question: Lengths = _RAG_QUESTION,
    osl: Lengths = _OSL_CHAT,
    seed: int = 0,
) -> Workload:
    """A shared short system prompt, one to three documents of a shared set (Zipf) and a
    question: requests share a prefix as far as their first document."""
    rng = random.Random(seed)
    (system,) = _texts("rag-system", seed, [system_tokens])
    srng = random.Random(f"rag-sizes-{seed}")
    docs = _texts("rag-doc", seed, [document.draw(srng) for _ in range(documents)])
    pick = _zipf(rng, documents, zipf)
    turns = []
    for at in _arrivals(rng, rate, count):
        chosen = [docs[pick()] for _ in range(rng.randint(1, 3))]
        content = " ".join([*chosen, _words(rng, question.draw(rng))])
        messages = [{"role": "system", "content": system}, {"role": "user", "content": content}]
        turns.append(Turn(at, messages, osl.draw(rng)))
    return Workload(
        "rag",
        turns,
        f"{documents} documents (Zipf {zipf}), 1-3 per request",
        {"rate": rate, "count": count, "documents": documents},
    )


def cold(
    rate: float,
    count: int,
    *,
    isl: Lengths = _COLD,
    osl: Lengths = _OSL_CHAT,
    seed: int = 0,
) -> Workload:
    """Unique prompts only: no request shares a prefix with another."""
    w = poisson(rate, count, isl, osl, seed=seed)
    w.name = "cold"
    w.description = f"unique {isl.lo}-{isl.hi}-token prompts"
    return w


def long_output(
    rate: float,
    count: int,
    *,
    tenants: int = 16,
    system_tokens: int = 2000,
    osl: Lengths = _LONG_ANSWER,
    seed: int = 0,
) -> Workload:
    """`shared_prefix` with few tenants and long answers (decode-bound)."""
    w = shared_prefix(rate, count, tenants=tenants, system_tokens=system_tokens, osl=osl, seed=seed)
    w.name = "long-output"
    w.description = f"{tenants} tenants x {system_tokens}-token system prompts, long answers"
    return w


def agent(
    rate: float,
    sessions: int,
    *,
    toolsets: int = 20,
    tools_tokens: int = 3000,
    turns: Lengths = _AGENT_TURNS,
    task: Lengths = _TASK,
    tool_result: Lengths = _TOOL_RESULT,
    osl: Lengths = _OSL_AGENT,
    think_s: float = 1.0,
    max_context: int = 7500,
    seed: int = 0,
) -> Workload:
    """Agent sessions starting at `rate`/s: a shared tool-definition prefix (one of
    `toolsets`), a task, then turns each appending a tool result after a short pause. A
    session ends early rather than grow past `max_context` tokens (prompt + answers so far +
    the next answer): the default leaves an 8192-token model room for the chat template."""
    rng = random.Random(seed)
    tools = _texts("agent-tools", seed, [tools_tokens] * toolsets)
    out = []
    for s, at in enumerate(_arrivals(rng, rate, sessions)):
        sid = f"a{s}"
        system = {"role": "system", "content": tools[rng.randrange(toolsets)]}
        first, answer = task.draw(rng), osl.draw(rng)
        msg = {"role": "user", "content": _words(rng, first)}
        out.append(Turn(at, [system, msg], answer, session=sid, user=sid))
        context = tools_tokens + first + answer
        for k in range(1, turns.draw(rng)):
            result, answer = tool_result.draw(rng), osl.draw(rng)
            if context + result + answer > max_context:
                break
            context += result + answer
            msg = {"role": "tool", "content": _words(rng, result)}
            pause = rng.expovariate(1 / think_s)
            out.append(Turn(pause, [msg], answer, session=sid, user=sid, turn=k))
    return Workload(
        "agent",
        out,
        f"{sessions} agent sessions over {toolsets} tool sets, {rate} sessions/s",
        {"rate": rate, "sessions": sessions, "toolsets": toolsets},
    )


def hot_prefix(
    rate: float,
    count: int,
    *,
    system_tokens: int = 5000,
    question: Lengths = _TASK,
    osl: Lengths = _OSL_CHAT,
    seed: int = 0,
) -> Workload:
    """One long system prompt shared by every request (every instance ends up holding it)."""
    w = shared_prefix(
        rate,
        count,
        tenants=1,
        system_tokens=system_tokens,
        users_per_tenant=1000,
        question=question,
        osl=osl,
        seed=seed,
    )
    w.name = "hot-prefix"
    w.description = f"one {system_tokens}-token system prompt shared by every request"
    return w


def trending_docs(
    rate: float,
    count: int,
    *,
    documents: int = 12,
    document: Lengths = _TRENDING_DOC,
    zipf: float = 1.4,
    shift_s: float = 15.0,
    question: Lengths = _QUESTION,
    follow_share: float = 0.3,
    follow: Lengths = _FOLLOW,
    think_s: float = 3.0,
    osl: Lengths = _OSL_CHAT,
    seed: int = 0,
) -> Workload:
    """Long documents asked about by many users, the most read ones changing every `shift_s`
    seconds (Zipf popularity over a shuffled order per period: what trends now was cold
    before); a `follow_share` of askers asks one follow-up after `think_s` (mean) seconds."""
    rng = random.Random(seed)
    srng = random.Random(f"trending-sizes-{seed}")
    docs = _texts("trending-doc", seed, [document.draw(srng) for _ in range(documents)])
    rank = _zipf(rng, documents, zipf)
    orders: dict[int, list[int]] = {}
    turns = []
    for s, at in enumerate(_arrivals(rng, rate, count)):
        period = int(at // shift_s)
        order = orders.get(period)
        if order is None:
            order = orders[period] = random.Random(f"trending-order-{seed}-{period}").sample(
                range(documents), documents
            )
        sid = f"d{s}"
        content = docs[order[rank()]] + " " + _words(rng, question.draw(rng))
        turns.append(
            Turn(at, [{"role": "user", "content": content}], osl.draw(rng), session=sid, user=sid)
        )
        if rng.random() < follow_share:
            msg = {"role": "user", "content": _words(rng, follow.draw(rng))}
            pause = rng.expovariate(1 / think_s)
            turns.append(Turn(pause, [msg], osl.draw(rng), session=sid, user=sid, turn=1))
    return Workload(
        "trending-docs",
        turns,
        f"{documents} documents (Zipf {zipf}, reshuffled every {shift_s:g} s), "
        f"{follow_share:.0%} ask a follow-up",
        {"rate": rate, "count": count, "documents": documents},
    )


def _per_session(
    turns: Lengths, make: Callable[[float, int, int], Workload]
) -> Callable[[float, float, int], Workload]:
    """A session workload as `(rate, duration_s, seed)` with `rate` in requests per second:
    `make(sessions per second, sessions, seed)`."""
    per = turns.expected

    def build(rate: float, duration_s: float, seed: int) -> Workload:
        sessions = rate / per
        return make(sessions, max(1, round(sessions * duration_s)), seed)

    return build


def _per_request(make: Callable[..., Workload]) -> Callable[[float, float, int], Workload]:
    return lambda rate, duration_s, seed: make(rate, max(1, round(rate * duration_s)), seed=seed)


_MULTI_TURNS = Lengths(5)
_TRENDING_FOLLOW = 0.3


def _trending_per_request(rate: float, duration_s: float, seed: int) -> Workload:
    # `rate` counts follow-ups too: first questions arrive at rate / (1 + follow-up share).
    first = rate / (1 + _TRENDING_FOLLOW)
    return trending_docs(
        first, max(1, round(first * duration_s)), follow_share=_TRENDING_FOLLOW, seed=seed
    )


#: The routing scorecard's training set: (rate req/s, duration s, seed) -> Workload.
TRAIN: dict[str, Callable[[float, float, int], Workload]] = {
    "shared-prefix": _per_request(
        lambda rate, n, seed: shared_prefix(rate, n, tenants=200, system_tokens=3000, seed=seed)
    ),
    "multi-turn": _per_session(
        _MULTI_TURNS,
        lambda rate, n, seed: multi_turn(
            rate, n, turns=5, system_tokens=1000, think_s=5.0, seed=seed
        ),
    ),
    "tenant-mix": _per_request(tenant_mix),
    "rag": _per_request(rag),
    "cold": _per_request(cold),
    "long-output": _per_request(long_output),
    # Held out until prefix warming was built for it (docs/benchmarks/scorecard.md).
    "hot-prefix": _per_request(hot_prefix),
}
#: Held out: never used to choose a parameter; checked last.
HELD_OUT: dict[str, Callable[[float, float, int], Workload]] = {
    "bursty-mix": _per_request(
        lambda rate, n, seed: tenant_mix(rate, n, tenants=50, zipf=1.3, cv=3.0, seed=seed)
    ),
    "agent": _per_session(_AGENT_TURNS, lambda rate, n, seed: agent(rate, n, seed=seed)),
    "trending-docs": _trending_per_request,
}
FAMILY = {**TRAIN, **HELD_OUT}


def load_trace(path: str | Path, *, limit: int = 0, seed: int = 0) -> Workload:
    """A JSONL trace (see the module docstring), replayed open loop at its own times (a
    `session` becomes the `user` field). Raises ValueError naming a bad line."""
    rng = random.Random(seed)
    out: list[Turn] = []
    lines: Iterable[str] = Path(path).read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            at = float(rec.get("at", rec.get("timestamp", 0.0)))
            if "messages" in rec:
                messages = list(rec["messages"])
            elif "prompt" in rec:
                messages = [{"role": "user", "content": str(rec["prompt"])}]
            else:
                messages = [{"role": "user", "content": _words(rng, int(rec["prompt_tokens"]))}]
            max_tokens = int(rec.get("output_tokens", rec.get("max_tokens", 128)))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}:{n}: {exc}") from exc
        out.append(Turn(at, messages, max_tokens, user=str(rec.get("session", ""))))
        if limit and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{path}: no requests")
    t0 = min(t.at for t in out)
    for t in out:
        t.at -= t0
    return Workload(Path(path).stem, out, f"trace {path}", {"path": str(path)})
