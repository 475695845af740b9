"""Relay benchmark: pdplane gateway + scheduler vs vllm-router vs xpyd-proxy vs direct-to-decode.

One run starts a registry and, per topology (1P1D, 2P4D) and knob set (zero think time,
realistic), the same `pdplane sim` backends; then each proxy in turn over those sims, driven by
the same closed-loop asyncio load generator (streaming chat, 16 tokens) at each concurrency.
Proxies (and pdplane's scheduler) are pinned to `--proxy-cpus`, the sims, registry and load
generator to `--load-cpus`. Reports req/s, latency p50/p99, added latency over the direct floor,
proxy CPU ms per request and the ratios against each peer.

`python-floor` (and `python-floor-fastapi`) is the cheapest relay on pdplane's own libraries
(uvicorn + aiohttp, `bench/relay/_floor_proxy.py`): what of pdplane's CPU per request is its
stack's.

Tokenizer: off by default: the sims publish none, so pdplane's gateways have no tokenizer and
estimate prompt lengths. `--tokenizer DIR|auto` makes the sims publish that tokenizer, and every
pdplane gateway then takes it from the fleet (as deployed: exact prompt ids and prefix hashes).
The report says which, and each pdplane row counts the prompts its gateway scheduled with exact
ids (`pdplane_gateway_prompts_total`) so that "on" and "off" are checked, not assumed.
`--repeat N` measures every point N times (the proxies in alternating order) and reports the
medians.

    .venv/bin/python bench/relay/relay.py                      # full run (~10 min)
    .venv/bin/python bench/relay/relay.py --quick              # 1P1D, zero knobs, short windows

Peers are installed in their own venvs (a run without one prints these commands and skips it):
    python3 -m venv .cache/peers/vllm-router && .cache/peers/vllm-router/bin/pip install vllm-router
    python3 -m venv .cache/peers/xpyd-proxy && .cache/peers/xpyd-proxy/bin/pip install xpyd-proxy
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench import ROOT
from bench._args import at_least
from bench._procs import Proc, spawn
from bench.relay.proxies import Fleet, check_name, install_hint, start_proxy
from pdplane.launch.ports import free_port_run
from tests.support.loadgen import run_load
from tests.support.stats import percentile

KNOBS: dict[str, list[str]] = {
    "zero": [],
    # A small model on a fast GPU: ~0.1 ms/prompt token prefill, 10 ms ITL, 0.02 ms/token pull.
    "realistic": [
        "--ttft-per-token-ms",
        "0.1",
        "--itl-ms",
        "10",
        "--kv-transfer-ms-per-token",
        "0.02",
    ],
}
TOPOLOGIES = {"1P1D": (1, 1), "2P4D": (2, 4)}


def _start_sims(
    role: str,
    count: int,
    knobs: list[str],
    registry: str,
    cpus: str,
    logs: Path,
    tokenizer: str = "",
) -> tuple[Proc, list[str]]:
    proc = spawn(
        f"sim-{role}",
        [
            sys.executable,
            "-m",
            "pdplane.cli.main",
            "sim",
            "--role",
            role,
            "--port",
            "0",
            "--instances",
            str(count),
            "--registry",
            registry,
            "--record-limit",
            "0",
            *(["--tokenizer", tokenizer] if tokenizer else []),
            *knobs,
        ],
        cpus,
        logs,
        stdout_pipe=True,
    )
    try:
        return proc, [line["url"] for line in proc.read_json_lines(count)]
    except BaseException:
        proc.stop()
        raise


def _prompt_counts(run: Any) -> dict[str, float] | None:
    """A pdplane gateway's scheduled prompts so far by how their ids were known ("exact",
    "estimated"; `pdplane_gateway_prompts_total`); None for other proxies."""
    if not run.name.startswith("pdplane"):
        return None
    text = httpx.get(run.url + "/metrics", timeout=10).text
    counts = {"exact": 0.0, "estimated": 0.0}
    for line in text.splitlines():
        if line.startswith("pdplane_gateway_prompts_total{"):
            for ids in counts:
                if f'ids="{ids}"' in line:
                    counts[ids] = float(line.rsplit(" ", 1)[1])
    return counts


def _measure(run: Any, args: argparse.Namespace, concurrency: int) -> dict[str, Any]:
    url = run.url + "/v1/chat/completions"
    # Warm-up at this concurrency (connections, caches), not counted; it also sizes the
    # window: at least `--duration` and 5 slowest-request times, so that saturated points
    # still complete enough requests to be measured.
    warm = asyncio.run(
        run_load(
            url, concurrency=concurrency, duration_s=0.3, warmup_s=0.0, max_tokens=args.max_tokens
        )
    )
    duration = max(args.duration, min(5 * warm.max_latency_ms / 1000, 4 * args.duration))
    prompts0 = _prompt_counts(run)
    split0, t0 = run.cpu_split(), time.perf_counter()
    result = asyncio.run(
        run_load(
            url,
            concurrency=concurrency,
            duration_s=duration,
            warmup_s=0.0,
            max_tokens=args.max_tokens,
        )
    )
    split = {k: v - split0[k] for k, v in run.cpu_split().items()}
    prompts1 = _prompt_counts(run)
    exact = None
    if prompts0 is not None and prompts1 is not None:
        n = {k: prompts1[k] - prompts0[k] for k in prompts1}
        exact = round(n["exact"] / (n["exact"] + n["estimated"]), 3) if sum(n.values()) else None
    cpu = sum(split.values())
    per_req = {k: round(v / result.ok, 3) for k, v in split.items()} if result.ok else {}
    return {
        "concurrency": concurrency,
        "duration_s": round(duration, 2),
        "ok": result.ok,
        "errors": result.errors,
        "first_error": result.first_error,
        "rps": round(result.rps, 1),
        "p50_ms": round(result.p(50), 2),
        "p99_ms": round(result.p(99), 2),
        "ttft_p50_ms": round(percentile(result.ttfts_ms, 50), 2),
        "proxy_cpu_ms_per_req": round(cpu / result.ok, 3) if result.ok and run.procs else 0.0,
        "cpu_ms_per_req_by_process": per_req,
        # pdplane: share of the window's prompts scheduled with exact ids (the tokenizer).
        "exact_prompts": exact,
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def _bench_cell(
    topology: str,
    knobs: str,
    proxies: list[str],
    registry: str,
    args: argparse.Namespace,
    logs: Path,
) -> list[dict[str, Any]]:
    n_p, n_d = TOPOLOGIES[topology]
    sims = (KNOBS[knobs], registry, args.load_cpus, logs, args.tokenizer)
    prefill, p_urls = _start_sims("prefill", n_p, *sims)
    try:
        decode, d_urls = _start_sims("decode", n_d, *sims)
    except BaseException:
        prefill.stop()
        raise
    fleet = Fleet(registry, p_urls, d_urls, tokenizer=args.tokenizer)
    rows: list[dict[str, Any]] = []
    skipped: set[str] = set()
    try:
        for rep in range(args.repeat):
            # Alternating order: a drift of the shared machine's load favours no proxy.
            for name in proxies if rep % 2 == 0 else proxies[::-1]:
                if name in skipped:
                    continue
                print(f"[{topology} {knobs} #{rep + 1}] {name}", file=sys.stderr, flush=True)
                try:
                    run = start_proxy(name, fleet, args.proxy_cpus, logs)
                except RuntimeError as exc:
                    print(f"  skipped: {exc}", file=sys.stderr)
                    skipped.add(name)
                    rows.append(
                        {"topology": topology, "knobs": knobs, "proxy": name, "skipped": str(exc)}
                    )
                    continue
                try:
                    for c in args.concurrency:
                        row = {
                            "topology": topology,
                            "knobs": knobs,
                            "proxy": name,
                            "rep": rep,
                            **_measure(run, args, c),
                        }
                        print(f"  {json.dumps(row)}", file=sys.stderr, flush=True)
                        rows.append(row)
                finally:
                    run.stop()
    finally:
        decode.stop()
        prefill.stop()
    return rows


def _fmt(v: float) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:g}"


def _cpu_cell(row: dict[str, Any]) -> str:
    split = row.get("cpu_ms_per_req_by_process") or {}
    total = f"{row['proxy_cpu_ms_per_req']}"
    if len(split) < 2:
        return total
    parts = " + ".join(f"{k.split('-')[1]} {v}" for k, v in split.items())
    return f"{total} ({parts})"


def _median_rows(cell: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (proxy, concurrency): the medians over its repetitions (errors summed)."""
    out: list[dict[str, Any]] = []
    keys: list[tuple[str, int]] = []
    for r in cell:
        if "rps" in r and (r["proxy"], r["concurrency"]) not in keys:
            keys.append((r["proxy"], r["concurrency"]))
    for proxy, c in keys:
        reps = [r for r in cell if r["proxy"] == proxy and r.get("concurrency") == c]
        row = dict(reps[0])
        for k in ("rps", "p50_ms", "p99_ms", "ttft_p50_ms", "proxy_cpu_ms_per_req", "ok"):
            row[k] = round(statistics.median(r[k] for r in reps), 3)
        exact = [r["exact_prompts"] for r in reps if r.get("exact_prompts") is not None]
        row["exact_prompts"] = statistics.median(exact) if exact else None
        row["errors"] = sum(r["errors"] for r in reps)
        row["reps"] = len(reps)
        row["cpu_ms_per_req_all"] = [r["proxy_cpu_ms_per_req"] for r in reps]
        split = reps[0].get("cpu_ms_per_req_by_process") or {}
        row["cpu_ms_per_req_by_process"] = {
            k: round(statistics.median(r["cpu_ms_per_req_by_process"].get(k, 0.0) for r in reps), 3)
            for k in split
        }
        out.append(row)
    out += [r for r in cell if "skipped" in r]
    return out


def report(rows: list[dict[str, Any]], tokenizer: str = "") -> str:
    """Markdown tables: per cell, per proxy and concurrency (medians over repetitions); then
    the ratios against the peers and against a "+base" run of the same proxy."""
    out: list[str] = [
        f"tokenizer: on (the sims publish {tokenizer}; pdplane gateways take it from the fleet)"
        if tokenizer
        else "tokenizer: off (the sims publish none; pdplane gateways estimate prompt lengths)"
    ]
    cells = sorted({(r["topology"], r["knobs"]) for r in rows}, key=str)
    for topology, knobs in cells:
        cell = _median_rows([r for r in rows if (r["topology"], r["knobs"]) == (topology, knobs)])
        floor = {r["concurrency"]: r for r in cell if r["proxy"] == "direct" and "rps" in r}
        reps = max((r.get("reps", 1) for r in cell), default=1)
        out += [
            f"\n### {topology}, {knobs} knobs (medians of {reps} runs)\n",
            "| proxy | streams | req/s | p50 ms | p99 ms | added p50 | added p99 "
            "| proxy CPU ms/req | CPU ms/req, each run | prompts exact | errors |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in cell:
            if "skipped" in r:
                out.append(f"| {r['proxy']} | skipped: {r['skipped'][:80]} |||||||||")
                continue
            f = floor.get(r["concurrency"])
            add50 = r["p50_ms"] - f["p50_ms"] if f else math.nan
            add99 = r["p99_ms"] - f["p99_ms"] if f else math.nan
            exact = "" if r.get("exact_prompts") is None else f"{r['exact_prompts']:.0%}"
            out.append(
                f"| {r['proxy']} | {r['concurrency']} | {r['rps']} | {r['p50_ms']} | "
                f"{r['p99_ms']} | {add50:.2f} | {add99:.2f} | {_cpu_cell(r)} | "
                f"{' / '.join(f'{v:g}' for v in r.get('cpu_ms_per_req_all', []))} | {exact} | "
                f"{r['errors']} |"
            )
        out.append("")
        out += _ratios(cell, floor)
    return "\n".join(out)


def _ratios(cell: list[dict[str, Any]], floor: dict[int, dict[str, Any]]) -> list[str]:
    def rows_of(name: str) -> list[dict[str, Any]]:
        return [r for r in cell if r["proxy"] == name and "rps" in r]

    def at(name: str, c: int) -> dict[str, Any] | None:
        return next((r for r in rows_of(name) if r["concurrency"] == c), None)

    def max_rps(name: str) -> float:
        return max((r["rps"] for r in rows_of(name) if r["errors"] == 0), default=math.nan)

    def cpu(name: str) -> float:
        # Windows with few completions (saturated 256-stream points) say little about cost.
        vals = [r["proxy_cpu_ms_per_req"] for r in rows_of(name) if r["ok"] >= 50]
        return sum(vals) / len(vals) if vals else math.nan

    def added99(name: str, c: int) -> float:
        r = at(name, c)
        return r["p99_ms"] - floor[c]["p99_ms"] if r and c in floor else math.nan

    def by_streams(ours: str, peer: str, key: str) -> str:
        parts = []
        for c in sorted({r["concurrency"] for r in rows_of(ours)}):
            a, b = at(ours, c), at(peer, c)
            if a and b and b[key]:
                parts.append(f"x{a[key] / b[key]:.2f} at {c}")
        return ", ".join(parts) or "n/a"

    lines = []
    ours_names = sorted(
        {r["proxy"] for r in cell if r["proxy"].startswith(("pdplane", "python-floor"))}
        - {"pdplane-concurrent"}
    )
    # The floor of pdplane's libraries is a peer of pdplane's proxies too.
    peers = ("vllm-router", "xpyd-proxy", "python-floor")
    for ours, peer in itertools.product(ours_names, peers):
        if ours == peer:
            continue
        if not rows_of(peer) or not rows_of(ours):
            continue
        lines.append(
            f"- {ours} vs {peer}: max req/s {max_rps(ours):g} vs {max_rps(peer):g} "
            f"(x{max_rps(ours) / max_rps(peer):.2f}); proxy CPU ms/req (mean over streams) "
            f"{cpu(ours):.3f} vs {cpu(peer):.3f} (x{cpu(ours) / cpu(peer):.2f}; "
            f"{by_streams(ours, peer, 'proxy_cpu_ms_per_req')} streams); added p99 at "
            f"64 streams {_fmt(round(added99(ours, 64), 2))} vs "
            f"{_fmt(round(added99(peer, 64), 2))} ms"
        )
    for ours in ours_names:
        base = ours.replace("+base", "") if "+base" in ours else None
        if base is None or not rows_of(base):
            continue
        lines.append(
            f"- {base} vs {ours} (same run): req/s {by_streams(base, ours, 'rps')} streams; "
            f"p99 {by_streams(base, ours, 'p99_ms')}; CPU ms/req "
            f"{by_streams(base, ours, 'proxy_cpu_ms_per_req')}"
        )
    if rows_of("pdplane-concurrent"):
        for c in sorted(floor):
            seq = at("pdplane", c)
            con = at("pdplane-concurrent", c)
            if seq and con:
                lines.append(
                    f"- dispatch at {c} streams: sequential p50 {seq['p50_ms']} ms / "
                    f"{seq['rps']} req/s, concurrent p50 {con['p50_ms']} ms / "
                    f"{con['rps']} req/s"
                )
    return lines


def _names(known: tuple[str, ...] | None) -> Callable[[str], str]:
    """An argparse type: a comma-separated list whose names are all in `known` (None: proxy
    names, `check_name`)."""

    def parse(text: str) -> str:
        for name in text.split(","):
            if known is None:
                try:
                    check_name(name)
                except ValueError as exc:
                    raise argparse.ArgumentTypeError(str(exc)) from None
            elif name not in known:
                raise argparse.ArgumentTypeError(f"{name!r}: one of {', '.join(known)}")
        return text

    return parse


def _counts(text: str) -> list[int]:
    """An argparse type: comma-separated positive integers."""
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers") from None
    if min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: each at least 1")
    return counts


def _commit(tree: Path) -> str:
    """The checked-out commit of `tree` ("" when it is not a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True
        )
    except OSError:
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topologies", default="1P1D,2P4D", type=_names(tuple(TOPOLOGIES)))
    parser.add_argument("--knobs", default="zero,realistic", type=_names(tuple(KNOBS)))
    parser.add_argument(
        "--proxies",
        default="direct,pdplane,pdplane-embedded,vllm-router,xpyd-proxy",
        type=_names(None),
        help="comma-separated; latency added is counted over `direct`, when it is among them",
    )
    parser.add_argument("--concurrency", default="1,16,64,256", type=_counts)
    parser.add_argument(
        "--duration", type=at_least(0.1, float), default=3.0, help="measured seconds per point"
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--proxy-cpus", default="0", help="taskset CPU list for proxies")
    parser.add_argument("--load-cpus", default="1", help="CPU list: sims, registry, load gen")
    parser.add_argument(
        "--no-dispatch-compare",
        action="store_true",
        help="skip pdplane's concurrent dispatch under realistic knobs",
    )
    parser.add_argument(
        "--tokenizer",
        default="",
        help='tokenizer directory of the sims, and of pdplane gateways named "+tok" or '
        '"+kv_aware" (e.g. pdplane-embedded+tok); "auto" = the tiny model\'s, built locally; '
        '"" = the sims\' word tokenizer',
    )
    parser.add_argument(
        "--repeat",
        type=at_least(1, int),
        default=1,
        help="runs of every point (medians are reported)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="1P1D, zero knobs, 1 s windows (in place of --topologies, --knobs, --duration)",
    )
    parser.add_argument(
        "--out", default="", help="results JSON (default logs/bench/relay-<UTC time>/relay.json)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.topologies, args.knobs, args.duration = "1P1D", "zero", 1.0
    proxies = args.proxies.split(",")
    if args.tokenizer == "auto":
        from pdplane.models.tiny import build_tiny_model

        cache = Path(os.environ.get("PDPLANE_MODEL_CACHE", Path.home() / ".cache/pdplane/models"))
        args.tokenizer = str(build_tiny_model(cache))
    for peer in ("vllm-router", "xpyd-proxy"):
        hint = install_hint(peer)
        if peer in proxies and hint:
            print(f"{peer} is not installed; skipping it. Install with:\n  {hint}", file=sys.stderr)
            proxies.remove(peer)
    # A folder per run: logs of concurrent runs must not overwrite each other.
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = ROOT / (args.out or f"logs/bench/relay-{stamp}/relay.json")
    logs = out.parent
    logs.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    os.sched_setaffinity(0, {int(c) for c in args.load_cpus.split(",")})
    reg_port = free_port_run()
    registry = spawn(
        "registry",
        [
            sys.executable,
            "-m",
            "pdplane.cli.main",
            "registry",
            "--port",
            str(reg_port),
            "--log-level",
            "WARNING",
        ],
        args.load_cpus,
        logs,
    )
    rows: list[dict[str, Any]] = []
    try:
        time.sleep(0.5)  # the sims retry registration anyway; this only avoids noisy logs
        for topology in args.topologies.split(","):
            for knobs in args.knobs.split(","):
                cell = list(proxies)
                if knobs == "realistic" and not args.no_dispatch_compare and "pdplane" in cell:
                    cell.append("pdplane-concurrent")
                rows += _bench_cell(topology, knobs, cell, f"127.0.0.1:{reg_port}", args, logs)
    finally:
        registry.stop()
    meta = {
        "argv": sys.argv,
        "commit": _commit(ROOT),
        "base_tree": os.environ.get("PDPLANE_BENCH_BASE_TREE", ""),
        "tokenizer": args.tokenizer or "off",
        "load_avg_before_after": [load_before, os.getloadavg()],
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"results: {out}", file=sys.stderr)
    print(report(rows, args.tokenizer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
