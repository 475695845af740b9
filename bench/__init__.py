"""Benchmark scripts (not installed with pdplane), one folder per subject (bench/<subject>/,
each with a README.md): each script prints numbers and ratios against a baseline measured in the
same run; docs/benchmarks/<subject>.md holds the current numbers with their commands.

Run from the checkout root, either way: `python -m bench.relay.relay ...` or `python
bench/relay/relay.py ...`. Scripts import their helpers as `bench.<subject>.<module>`, and what
they share with the tests as `tests.support.<module>`: the checkout root is on the path of the
project's editable install (`dev-mode-dirs` in pyproject.toml), of pytest (`pythonpath`), and of
`python -m` from the root; the GPU scripts put it on `PYTHONPATH` themselves.
"""

from pathlib import Path

#: The checkout root (results default to ROOT/logs/bench/).
ROOT = Path(__file__).resolve().parents[1]
