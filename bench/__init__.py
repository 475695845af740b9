"""Benchmark scripts (not installed with pdplane): each prints numbers and ratios against a
baseline measured in the same run; docs/benchmarks/ holds the current numbers with their commands.

Run from the checkout root, either way: `python -m bench.relay ...` or `python bench/relay.py
...`. Scripts import their helpers as `bench.<module>`: the checkout root is on the path of the
project's editable install (`dev-mode-dirs` in pyproject.toml), of pytest (`pythonpath`), and of
`python -m` from the root; the GPU scripts put it on `PYTHONPATH` themselves.
"""
