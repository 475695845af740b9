"""`bench/relay.py` with a before/after of pdplane in one run.

`--base-tree DIR` adds the proxy `pdplane-base`: relay.py's `pdplane` (gateway + scheduler
process) run from another checkout, next to the current `pdplane`, `pdplane-embedded`
(`--scheduler embedded`) and the peers, over the same sims and load generator; `base-<name>`
runs relay.py's proxy <name> (e.g. `base-pdplane-embedded+tok`) from it. Prints relay.py's
tables plus one ratio line per pdplane variant against each peer.

    .venv/bin/python bench/gateway_modes.py --topologies 1P1D,2P4D --knobs zero --duration 2 \\
        --base-tree /tmp/pdp_base --concurrency 1,16,64 \\
        --proxies direct,pdplane-base,pdplane,pdplane-embedded,vllm-router,xpyd-proxy

Make the other checkout with e.g. `git archive <commit> services connector | tar -x -C DIR`.
Every relay.py flag applies (`--out PATH` as two words; default logs/bench/gateway_modes.json).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import relay  # noqa: E402
from bench._proxies import Fleet, ProxyRun, start_proxy  # noqa: E402

_PEERS = ("vllm-router", "xpyd-proxy")
_base_tree: Path | None = None


@contextlib.contextmanager
def _python_path(tree: Path) -> Iterator[None]:
    """Processes spawned in the block import pdplane from `tree` (ahead of the editable one)."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = f"{tree / 'services'}:{tree / 'connector'}"
    try:
        yield
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


def _start_proxy(name: str, fleet: Fleet, cpus: str, logs: Path) -> ProxyRun:
    # "pdplane-base" = relay.py's "pdplane" from the base tree; "base-<name>" = <name> from it.
    if name != "pdplane-base" and not name.startswith("base-"):
        return start_proxy(name, fleet, cpus, logs)
    if _base_tree is None:
        raise RuntimeError(f"{name} needs --base-tree DIR")
    with _python_path(_base_tree):
        run = start_proxy("pdplane" if name == "pdplane-base" else name[5:], fleet, cpus, logs)
    run.name = name
    return run


def _cpu(measured: list[dict[str, Any]], name: str) -> float:
    # Windows with few completions (saturated points) say little about cost, as in relay.py.
    vals = [r["proxy_cpu_ms_per_req"] for r in measured if r["proxy"] == name and r["ok"] >= 50]
    return sum(vals) / len(vals) if vals else math.nan


def _added99(measured: list[dict[str, Any]], name: str, streams: int = 64) -> float:
    floor = next(
        (r for r in measured if r["proxy"] == "direct" and r["concurrency"] == streams), None
    )
    r = next((r for r in measured if r["proxy"] == name and r["concurrency"] == streams), None)
    return r["p99_ms"] - floor["p99_ms"] if r and floor else math.nan


def _summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per cell and pdplane variant: mean CPU ms/req and added p99 at 64 streams vs each peer."""
    lines = []
    for cell in sorted({(r["topology"], r["knobs"]) for r in rows}):
        measured = [r for r in rows if (r["topology"], r["knobs"]) == cell and "rps" in r]
        names = sorted({r["proxy"] for r in measured if r["proxy"].startswith("pdplane")})
        for ours in names:
            for peer in _PEERS:
                if any(r["proxy"] == peer for r in measured):
                    mine, theirs = _cpu(measured, ours), _cpu(measured, peer)
                    lines.append(
                        f"- {cell[0]} {cell[1]}: {ours} vs {peer}: CPU ms/req {mine:.3f} vs "
                        f"{theirs:.3f} (x{mine / theirs:.2f}); added p99 at 64 streams "
                        f"{_added99(measured, ours):.2f} vs {_added99(measured, peer):.2f} ms"
                    )
    return lines


def main(argv: list[str]) -> int:
    global _base_tree
    if "--base-tree" in argv:
        at = argv.index("--base-tree")
        _base_tree = Path(argv[at + 1]).resolve()
        argv = argv[:at] + argv[at + 2 :]
    if "--out" not in argv:
        argv = [*argv, "--out", "logs/bench/gateway_modes.json"]
    out = ROOT / argv[argv.index("--out") + 1]
    relay.start_proxy = _start_proxy  # relay.py resolves its proxies through this name
    code = relay.main(argv)
    print("\n" + "\n".join(_summary(json.loads(out.read_text())["rows"])))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
