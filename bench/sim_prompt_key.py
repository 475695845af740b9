"""The sim's sampling key per request: the prompt's text (before) vs its token ids (now).

    .venv/bin/python bench/sim_prompt_key.py [--lengths 100 2000 8000] [--rounds 3]

A sim seeds each answer's sampler with a key of the prompt. Before, the key was a text
prompt's text (an id prompt's JSON); now it is `prompt_key(ids)`, the prompt's
`prompt_fingerprint`, so text and id prompts answer alike and a decode can continue a
prefill's answer. Prints per prompt length the median us per request of each key + seeding
the sampler, of `WordTokenizer.encode` (the tokenization every request already pays), and
the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT / "services"))

from pdplane.sim.tokens import WordTokenizer, _rng, prompt_key  # noqa: E402


def _us(f: Callable[[], object], rounds: int) -> float:
    """Median over `rounds` of the best of 5 x 200 calls (us per call)."""
    return statistics.median(
        min(timeit.repeat(f, number=200, repeat=5)) / 200 * 1e6 for _ in range(rounds)
    )


def _row(tok: WordTokenizer, n: int, rounds: int) -> dict[str, float]:
    text = " ".join(f"w{i % 997}" for i in range(n))
    ids = tok.encode(text)
    t = {
        "text_key": _us(lambda: _rng(text, 0), rounds),
        "json_ids_key": _us(
            lambda: _rng(json.dumps(ids, sort_keys=True, separators=(",", ":")), 0), rounds
        ),
        "ids_key": _us(lambda: _rng(prompt_key(ids), 0), rounds),
        "encode": _us(lambda: tok.encode(text), rounds),
    }
    row = {k: round(v, 1) for k, v in t.items()}
    row.update(
        tokens=n,
        ids_vs_text=round(t["ids_key"] / t["text_key"], 2),
        ids_vs_json_ids=round(t["ids_key"] / t["json_ids_key"], 2),
        ids_vs_encode=round(t["ids_key"] / t["encode"], 3),
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[100, 2000, 8000])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tok = WordTokenizer()
    for n in args.lengths:
        print(json.dumps(_row(tok, n, args.rounds)), flush=True)


if __name__ == "__main__":
    main()
