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
- `load_trace`: replay of a JSONL trace (`{"at": s, "prompt": text | "messages": [...] |
  "prompt_tokens": N, "output_tokens" | "max_tokens": N, "session": id}` per line).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdplane.models import tiny
from pdplane.plan.workload import Lengths, arrival_times

__all__ = [
    "Lengths",
    "Turn",
    "Workload",
    "bursty",
    "load_trace",
    "multi_turn",
    "poisson",
    "seed_long_output",
    "shared_prefix",
]

_QUESTION = Lengths(100, "uniform", 50, 150)
_FIRST = Lengths(400, "uniform", 300, 500)
_FOLLOW = Lengths(80, "uniform", 40, 120)
_OSL_SHORT = Lengths(150, "uniform", 100, 200)
_OSL_SEED = Lengths(2500, "uniform", 2000, 3000)

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
