"""Workloads for planning: request arrival times and prompt / output lengths (tokens).

The planner needs only the shape of a workload, not its text: when requests arrive and how
many tokens each prompt and answer has. Named shapes (`SHAPES`) follow the benchmarks'
workloads (`bench/routing/workloads.py`, same length distributions) plus the prefill-heavy case; a
JSONL trace file gives one request per line (`{"at": s, "prompt_tokens": N,
"output_tokens": N}`; `prompt` text counts one token per word, `max_tokens` stands for
`output_tokens`).

    seed-long-output   ~1k-token prompts (900..1100), 2-3k-token answers, 10 req/s
    prefill-heavy      ~8k-token prompts (7600..7990), 200-token answers, 10 req/s
    poisson:isl=1000,osl=200,rate=5   any fixed-length Poisson shape
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SHAPES", "Lengths", "RequestSpec", "Shape", "arrival_times", "load_workload"]


@dataclass(frozen=True, slots=True)
class Lengths:
    """A length distribution (tokens): "fixed" (mean), "uniform" (lo..hi), "lognormal" (mean,
    sigma of the log), clipped to [lo, hi]."""

    mean: int
    kind: str = "fixed"
    lo: int = 1
    hi: int = 1 << 20
    sigma: float = 0.5

    def draw(self, rng: random.Random) -> int:
        if self.kind == "uniform":
            return rng.randint(self.lo, self.hi)
        if self.kind == "lognormal":
            mu = math.log(self.mean) - self.sigma**2 / 2
            return min(self.hi, max(self.lo, round(rng.lognormvariate(mu, self.sigma))))
        return self.mean

    @property
    def expected(self) -> float:
        """Mean of the distribution (tokens)."""
        return (self.lo + self.hi) / 2 if self.kind == "uniform" else float(self.mean)


def arrival_times(rng: random.Random, rate: float, count: int, cv: float = 1.0) -> list[float]:
    """`count` arrival times (s) with mean gap 1/rate: exponential gaps (cv 1, Poisson) or
    gamma gaps of coefficient of variation `cv` (> 1: bursty)."""
    t, out = 0.0, []
    shape = 1.0 / (cv * cv)
    for _ in range(count):
        t += rng.gammavariate(shape, 1.0 / (rate * shape))
        out.append(t)
    return out


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request: arrival (s from the start), prompt and output lengths (tokens)."""

    at: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Shape:
    """A workload shape: Poisson arrivals at `rate` req/s with these length distributions."""

    name: str
    rate: float
    isl: Lengths
    osl: Lengths
    cv: float = 1.0

    def requests(self, duration_s: float, *, rate: float = 0.0, seed: int = 0) -> list[RequestSpec]:
        """Requests arriving over `duration_s` at `rate` (default the shape's), seeded."""
        r = rate or self.rate
        rng = random.Random(seed)
        times = arrival_times(rng, r, max(1, round(r * duration_s)), self.cv)
        return [RequestSpec(t, self.isl.draw(rng), self.osl.draw(rng)) for t in times]


SHAPES: dict[str, Shape] = {
    "seed-long-output": Shape(
        "seed-long-output",
        10.0,
        Lengths(1000, "uniform", 900, 1100),
        Lengths(2500, "uniform", 2000, 3000),
    ),
    "prefill-heavy": Shape(
        "prefill-heavy", 10.0, Lengths(7800, "uniform", 7600, 7990), Lengths(200)
    ),
}


def _poisson(spec: str) -> Shape:
    # "poisson:isl=1000,osl=200,rate=5,cv=1"
    fields = dict(kv.split("=", 1) for kv in spec.split(":", 1)[1].split(",") if kv)
    unknown = set(fields) - {"isl", "osl", "rate", "cv"}
    if unknown:
        raise ValueError(f"workload {spec!r}: unknown fields {sorted(unknown)}")
    isl, osl = _field(spec, fields, "isl", 1000, int), _field(spec, fields, "osl", 200, int)
    rate, cv = _field(spec, fields, "rate", 1.0, float), _field(spec, fields, "cv", 1.0, float)
    return Shape(spec, rate, Lengths(int(isl)), Lengths(int(osl)), cv)


def _field(spec: str, fields: dict[str, str], name: str, default: float, kind: type) -> float:
    """One field of a `poisson:` workload: a finite number above 0 (`kind` int: a whole one).

    Raises ValueError naming the field and the workload."""
    raw = fields.get(name)
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        what = "a whole number" if kind is int else "a finite number"
        raise ValueError(f"workload {spec!r}: {name} must be {what} above 0 (got {raw!r})")
    return float(value)


def _trace(path: Path) -> list[RequestSpec]:
    out: list[RequestSpec] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            at = float(rec.get("at", rec.get("timestamp", 0.0)))
            if "prompt_tokens" in rec:
                isl = int(rec["prompt_tokens"])
            else:
                isl = len(str(rec["prompt"]).split())
            osl = int(rec.get("output_tokens", rec.get("max_tokens", 128)))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}:{n}: {exc}") from exc
        if isl < 1 or osl < 1:
            raise ValueError(f"{path}:{n}: prompt and output need at least one token")
        out.append(RequestSpec(at, isl, osl))
    if not out:
        raise ValueError(f"{path}: no requests")
    t0 = min(r.at for r in out)
    return sorted(
        (RequestSpec(r.at - t0, r.prompt_tokens, r.output_tokens) for r in out), key=lambda r: r.at
    )


def load_workload(name_or_path: str) -> Shape | list[RequestSpec]:
    """A named shape (`SHAPES`), a `poisson:isl=..,osl=..,rate=..` shape, or a JSONL trace.

    Raises ValueError naming the known shapes when none matches, or a bad trace line.
    """
    if name_or_path in SHAPES:
        return SHAPES[name_or_path]
    if name_or_path.startswith("poisson:"):
        return _poisson(name_or_path)
    path = Path(name_or_path)
    if path.is_file():
        return _trace(path)
    raise ValueError(
        f"unknown workload {name_or_path!r}; known: {', '.join(SHAPES)}, "
        "poisson:isl=N,osl=N,rate=R or a JSONL trace file"
    )
