"""The routing scorecard: every workload x load x router x seed on the virtual-clock fleet.

Each point runs one workload of the family (`bench/routing/workloads.py` `FAMILY`: a training set
and a held-out set) at a fraction of the fleet's capacity on an XpYd fleet of simulated engines
(`pdplane.plan.fleetsim`, virtual time: no wall clock, no simulator lag, deterministic per
seed), routed by the scheduler's own decision code and prefix index (`pdplane.plan.routesim`:
`kv_aware` with the shipped defaults, and the load-only policies `least_loaded`,
`power_of_two`, `round_robin`) or by the cache-knowing oracle.

The client's first token comes from prefill, as the gateway streams it by default
(docs/first-token.md; `--first-token decode` for the other path): TTFT is prefill's answer, and
the gap from the first token to the second (the pull, decode's admission and step) is an ITL
sample.

Capacity: requests per second at which `pdplane plan`'s closed form (`pdplane.plan.search.
capacity`) has the fleet's bottleneck role fully busy with no prefix cache hits, for the
workload's mean prompt and answer lengths (every turn counted); load 1.0 is that rate.

    python bench/routing/scorecard.py                       # the whole grid (docs/scheduler.md)
    python bench/routing/scorecard.py --topologies 4P4D --workloads cold,tenant-mix --loads 0.6 \
        --seeds 0 --routers kv_aware,least_loaded
    python bench/routing/scorecard.py --report results.jsonl   # tables of an earlier run
    python bench/routing/scorecard.py --served --topologies 4P4D --workloads tenant-mix \
        --loads 0.6 --seeds 0 --virtual results.jsonl --time-scale 0.5  # the points, served

Results: one JSON line per point in `--out` (a rerun skips the points already there), then the
report on stdout: per topology, one row per workload and load, kv_aware's ratio to the best
load-only policy (the lowest seed mean of the three, per metric) and to the oracle, as the
mean over seeds of the paired (same workload draw) ratios with their range.

`--served` runs the same points through `bench/routing/routing.py` instead: served sims (one
process, `pdplane sim`'s real-time runner at `--time-scale`), a registry, the pdplane gateway with
its embedded scheduler (every row tokenizes with the tiny model's tokenizer, every row's sims serve
KV events streams to a subscriber; kv_aware predicts with the sims' profile stretched to the wall
clock, `routing.kv_profile_for`) or the sims' own oracle; a point whose sims lag the clock by
more than 5 % is marked invalid. With `--virtual FILE` (the grid's results) each served number
is shown beside the virtual one of the same point and seed.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from bench import ROOT
from bench.routing import workloads as wl
from pdplane.plan.fleetsim import FIRST_TOKEN_MODES, FleetConfig
from pdplane.plan.routesim import ChatTraffic, ChatTurn, run_routed
from pdplane.plan.search import capacity
from pdplane.scheduler.policies.kv_aware import KvAwareWeights
from pdplane.scheduler.warming import WarmSettings
from pdplane.sim.profiles import load_profile

TOPOLOGIES = {"4P4D": (4, 4), "8P16D": (8, 16)}
LOADS = (0.3, 0.6, 0.9, 1.2)
LOAD_ONLY = ("least_loaded", "power_of_two", "round_robin")
ROUTERS = ("kv_aware", *LOAD_ONLY, "oracle")
SEEDS = (0, 1, 2)
METRICS = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p99_ms")
#: template tokens per chat message and for the reply (`pdplane.sim.tokens`)
_PER_MESSAGE, _PRIMER = 4, 3


@dataclass(frozen=True, slots=True)
class Point:
    """One run's settings (everything needed to repeat it)."""

    topology: str
    workload: str
    load: float
    router: str
    seed: int
    profile: str = "llama3-8b-h100"
    duration_s: float = 60.0
    warmup_s: float = 20.0
    itl_slo_s: float = 0.05
    ttft_slo_s: float = 2.0
    #: kv_aware's knobs other than the shipped defaults: "itl_weight=0.5,local_slack=0"
    kv: str = ""
    #: where the client's first token comes from (`pdplane.plan.fleetsim.FIRST_TOKEN_MODES`;
    #: "decode" in result files written before the flag existed)
    first_token: str = "decode"

    @property
    def key(self) -> tuple[Any, ...]:
        return (
            self.topology,
            self.workload,
            self.load,
            self.router,
            self.seed,
            self.kv,
            self.first_token,
        )


def sessions(workload: wl.Workload) -> list[list[ChatTurn]]:
    """The workload's turns grouped into sessions (a one-off request is a session of one),
    sorted by first arrival."""
    grouped: dict[object, list[wl.Turn]] = {}
    for n, t in enumerate(workload.turns):
        grouped.setdefault(t.session or n, []).append(t)
    out = [
        [ChatTurn(t.at, t.messages, t.max_tokens) for t in sorted(g, key=lambda t: t.turn)]
        for g in grouped.values()
    ]
    out.sort(key=lambda s: s[0].at)
    return out


def mean_lengths(workload: wl.Workload) -> tuple[float, float]:
    """(mean prompt, mean answer) tokens over every turn, a follow-up's prompt counting its
    history with answers of their full length."""
    prompts: list[int] = []
    answers: list[int] = []
    for session in sessions(workload):
        history = 0
        for turn in session:
            new = sum(len(m["content"].split()) + _PER_MESSAGE for m in turn.messages)
            prompts.append(history + new + _PRIMER)
            answers.append(turn.max_tokens)
            history += new + turn.max_tokens + _PER_MESSAGE
    return statistics.fmean(prompts), statistics.fmean(answers)


def fleet_capacity(p: Point) -> float:
    """The workload's capacity on the point's fleet (requests/s, module doc), from a draw at
    an arbitrary rate (lengths do not depend on it)."""
    isl, osl = mean_lengths(wl.FAMILY[p.workload](10.0, 60.0, p.seed))
    x, y = TOPOLOGIES[p.topology]
    return capacity(load_profile(p.profile), isl, osl, p.itl_slo_s, x, y)


def kv_options(kv: str) -> dict[str, Any]:
    """`Decider` keyword arguments of a `--kv` value ("itl_weight=10,warm_min_tokens=0,...":
    `KvAwareWeights` fields, `local_prefill_max_tokens`, `warm_` + `WarmSettings` fields).
    Raises ValueError naming a knob that is unknown, repeated or not a number."""
    if not kv:
        return {}
    knobs: dict[str, str] = {}
    for item in kv.split(","):
        name, eq, value = item.partition("=")
        if not eq or not name or name in knobs:
            raise ValueError(f"--kv: {item!r} is not NAME=VALUE or repeats a knob")
        knobs[name] = value
    warm_fields = {f.name for f in fields(WarmSettings)}
    weight_fields = {f.name for f in fields(KvAwareWeights)}
    known = {f"warm_{f}" for f in warm_fields} | weight_fields | {"local_prefill_max_tokens"}
    unknown = sorted(set(knobs) - known)
    if unknown:
        raise ValueError(f"--kv: unknown knob {unknown[0]!r}; known: {', '.join(sorted(known))}")

    def number(name: str, kind: type[int] | type[float]) -> Any:
        try:
            return kind(knobs[name])
        except ValueError:
            raise ValueError(f"--kv: {name}={knobs[name]!r} is not a number") from None

    options: dict[str, Any] = {}
    defaults = WarmSettings()
    warm = {
        k[5:]: number(k, type(getattr(defaults, k[5:]))) for k in knobs if k.startswith("warm_")
    }
    if warm:
        options["warm"] = replace(defaults, **warm)
    if "local_prefill_max_tokens" in knobs:
        options["local_prefill_max_tokens"] = number("local_prefill_max_tokens", int)
    weights = {k: number(k, float) for k in knobs if k in weight_fields}
    if weights:
        options["kv_weights"] = KvAwareWeights(**weights)
    return options


def run_point(p: Point) -> dict[str, Any]:
    """Runs one point; returns its settings, rate, numbers and the run's CPU seconds."""
    started = time.process_time()
    rate = p.load * fleet_capacity(p)
    workload = wl.FAMILY[p.workload](rate, p.duration_s, p.seed)
    x, y = TOPOLOGIES[p.topology]
    options = kv_options(p.kv) if p.router == "kv_aware" else {}
    result = run_routed(
        load_profile(p.profile),
        FleetConfig(prefill=x, decode=y),
        ChatTraffic(sessions(workload), p.seed),
        p.router,
        warmup_s=p.warmup_s,
        ttft_slo_s=p.ttft_slo_s,
        itl_slo_s=p.itl_slo_s,
        seed=p.seed,
        first_token=p.first_token,
        **options,
    )
    return {
        "point": asdict(p),
        "rate": rate,
        **result.numbers(),
        "cpu_s": time.process_time() - started,
    }


# -- report --------------------------------------------------------------------------------


def _mean(values: Iterable[float]) -> float:
    v = list(values)
    return statistics.fmean(v) if v else float("nan")


def _ratio_cell(pairs: list[tuple[float, float]]) -> tuple[str, float, float]:
    """'mean (min-max)' of per-seed ratios a/b, the ratio of the means, and the baseline's
    seed spread (half its range over its mean)."""
    ratios = [a / b for a, b in pairs if b > 0]
    if not ratios:
        return "n/a", float("nan"), float("nan")
    base = [b for _, b in pairs]
    spread = (max(base) - min(base)) / 2 / _mean(base) if _mean(base) > 0 else 0.0
    overall = _mean(a for a, _ in pairs) / _mean(base)
    cell = f"{overall:.2f}"
    if len(ratios) > 1:
        cell += f" ({min(ratios):.2f}-{max(ratios):.2f})"
    return cell, overall, spread


def verdicts(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (topology, workload, load, first-token mode) and kv_aware variant (`Point.kv`, ""
    = the shipped defaults): kv_aware against the best load-only policy per metric and
    against the oracle and round_robin, with the seed spreads (the rows of `report`). Runs of
    another first-token mode are never compared (files written before the flag: "decode")."""
    by: dict[tuple[Any, ...], dict[tuple[str, str], list[dict[str, Any]]]] = {}
    for r in results:
        p = r["point"]
        key = (p["topology"], p["workload"], p["load"], p.get("first_token") or "decode")
        variant = p.get("kv", "") if p["router"] == "kv_aware" else ""
        by.setdefault(key, {}).setdefault((p["router"], variant), []).append(r)
    rows = []
    for (topo, work, load, first), runs in sorted(by.items(), key=lambda kv: _order(kv[0])):
        routers = {name: found for (name, variant), found in runs.items() if name != "kv_aware"}
        for (name, variant), found in sorted(runs.items()):
            if name == "kv_aware":
                row = _verdict({r["point"]["seed"]: r for r in found}, routers, load)
                rows.append(
                    {"topology": topo, "workload": work, "load": load, "first_token": first}
                    | {"kv": variant}
                    | row
                )
    return rows


def _verdict(
    kv: dict[int, dict[str, Any]], routers: dict[str, list[dict[str, Any]]], load: float
) -> dict[str, Any]:
    """One row's cells: kv_aware's runs by seed against the other routers' runs."""
    row: dict[str, Any] = {"cells": {}}
    ok = True
    for metric in METRICS:
        best_name, best_mean = "", float("inf")
        for name in LOAD_ONLY:
            m = _mean(r[metric] for r in routers.get(name, []))
            if m < best_mean:
                best_name, best_mean = name, m
        base = {r["point"]["seed"]: r for r in routers.get(best_name, [])}
        pairs = [(kv[s][metric], base[s][metric]) for s in kv if s in base]
        cell, ratio, spread = _ratio_cell(pairs)
        allowed = 1.0 + min(spread, 0.05)
        row["cells"][metric] = (cell, best_name, ratio, spread)
        if load < 1.0 and ratio > allowed:
            ok = False
    oracle = {r["point"]["seed"]: r for r in routers.get("oracle", [])}
    rr = {r["point"]["seed"]: r for r in routers.get("round_robin", [])}
    hit_gap = _mean(kv[s]["fleet_hit"] - oracle[s]["fleet_hit"] for s in kv if s in oracle)
    row["hit_gap_points"] = hit_gap * 100
    row["oracle_p90"] = _ratio_cell(
        [(kv[s]["ttft_p90_ms"], oracle[s]["ttft_p90_ms"]) for s in kv if s in oracle]
    )
    row["rr_p90"] = _ratio_cell(
        [(rr[s]["ttft_p90_ms"], kv[s]["ttft_p90_ms"]) for s in kv if s in rr]
    )
    row["kv_hit"] = _mean(r["fleet_hit"] for r in kv.values())
    row["legs"] = _mean(r["prefill_legs_per_request"] for r in kv.values())
    row["ok"] = ok and hit_gap >= -0.03
    return row


def _order(key: tuple[Any, ...]) -> tuple[Any, ...]:
    topo, work, load, first = key
    names = list(wl.FAMILY)
    topos = list(TOPOLOGIES)
    return (
        topos.index(topo) if topo in topos else 99,
        first,
        names.index(work) if work in names else 99,
        load,
    )


def report(results: list[dict[str, Any]]) -> str:
    """Markdown: one table per topology (module doc)."""
    out: list[str] = []
    rows = verdicts(results)
    modes = sorted({r["first_token"] for r in rows})
    for topo, first in [(t, m) for t in TOPOLOGIES for m in modes]:
        mine = [r for r in rows if r["topology"] == topo and r["first_token"] == first]
        if not mine:
            continue
        out += [
            f"\n### {topo}, first token from {first}\n",
            "| workload | load | TTFT p50 | TTFT p90 | TTFT p99 | ITL p99 | fleet hit (vs oracle) "
            "| P legs/req | p90 / oracle | RR p90 / kv_aware | |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in mine:
            held = " (held out)" if r["workload"] in wl.HELD_OUT else ""
            held += f" [kv {r['kv']}]" if r["kv"] else ""
            cells = [f"{c[0]} {_short(c[1])}" for c in (r["cells"][m] for m in METRICS)]
            out.append(
                f"| {r['workload']}{held} | {r['load']:g} | "
                + " | ".join(cells)
                + f" | {r['kv_hit']:.0%} ({r['hit_gap_points']:+.1f}) | {r['legs']:.2f} "
                f"| {r['oracle_p90'][0]} | {r['rr_p90'][0]} | {'ok' if r['ok'] else 'MISS'} |"
            )
    return "\n".join(out)


def _short(name: str) -> str:
    return {"least_loaded": "LL", "power_of_two": "P2", "round_robin": "RR"}.get(name, name)


# -- the grid ------------------------------------------------------------------------------


def _run_safe(p: Point) -> dict[str, Any]:
    try:
        return run_point(p)
    except Exception as exc:  # one failed point must not lose the grid
        return {"point": asdict(p), "error": repr(exc)}


#: scorecard router -> bench/routing/routing.py row
SERVED_ROWS = {
    "kv_aware": "pdplane:kv_aware",
    "least_loaded": "pdplane:least_loaded",
    "power_of_two": "pdplane:power_of_two",
    "round_robin": "pdplane:round_robin",
    "oracle": "oracle",
}
_SERVED_METRICS = (*METRICS, "fleet_hit", "prefill_legs_per_request")
_SERVED_FORMATS = {"fleet_hit": "{:.0%}", "prefill_legs_per_request": "{:.2f}"}


def run_served(p: Point, time_scale: float, logs: Path) -> dict[str, Any]:
    """The point on served sims (module doc), as `run_point`'s result plus the sims' lag,
    whether the point is valid, and the gateway's CPU per request."""
    from bench.routing import routing

    rate = p.load * fleet_capacity(p)
    point = routing.Point(
        topology=p.topology,
        workload=f"family:{p.workload}",
        rate=rate,
        row=SERVED_ROWS[p.router],
        duration_s=p.duration_s,
        warmup=p.warmup_s / p.duration_s,
        drain_s=10.0,
        profile=p.profile,
        time_scale=time_scale,
        seed=p.seed,
        tokenizer="tiny",
    )
    r = routing.run_point(point, logs / f"{p.workload}-{p.load:g}-{p.router}-s{p.seed}")
    return {
        "point": asdict(p),
        "served": True,
        "rate": rate,
        "time_scale": time_scale,
        **{k: r[k] for k in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p99_ms")},
        "fleet_hit": r["fleet_hit_rate"],
        "prefill_legs_per_request": r["prefill_legs_per_request"],
        "requests": r["requests"],
        "sim_lag_fraction": r["sim_lag_fraction"],
        "valid": r["valid"],
        "proxy_cpu_ms_per_request": r["proxy_cpu_ms_per_request"],
        # prefix warms proposed by the gateway's scheduler / sent, failed or dropped by it
        **{k: r[k] for k in ("warms", "warms_sent_failed_dropped") if k in r},
    }


def served_report(served: list[dict[str, Any]], virtual: list[dict[str, Any]]) -> str:
    """Markdown: per served point, each router's served numbers / the virtual ones (same
    point and seed), and kv_aware's ratio to the best load-only row in each."""
    by_key = {Point(**r["point"]).key: r for r in virtual}
    out = [
        "| point | router | TTFT p50 | p90 | p99 | ITL p99 | fleet hit | P legs/req | lag "
        "| valid |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in served:
        p = Point(**r["point"])
        v = by_key.get(p.key)
        cells = []
        for m in _SERVED_METRICS:
            fmt = _SERVED_FORMATS.get(m, "{:.0f}")
            cell = fmt.format(r[m])
            if v is not None:
                cell += " / " + fmt.format(v[m])
            cells.append(cell)
        out.append(
            f"| {p.topology} {p.workload} {p.load:g} s{p.seed} | {p.router} | "
            + " | ".join(cells)
            + f" | {r['sim_lag_fraction']:.1%} | {'yes' if r['valid'] else 'NO'} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--topologies", default=",".join(TOPOLOGIES))
    ap.add_argument("--workloads", default=",".join(wl.FAMILY))
    ap.add_argument("--loads", default=",".join(f"{x:g}" for x in LOADS))
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--seeds", default=",".join(str(s) for s in SEEDS))
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--duration", type=float, default=60.0, help="modelled s of arrivals")
    ap.add_argument("--warmup", type=float, default=20.0, help="modelled s left out")
    ap.add_argument(
        "--kv",
        default="",
        help="kv_aware knobs other than the defaults: itl_weight=X,local_slack=X,"
        "local_prefill_max_tokens=N",
    )
    ap.add_argument(
        "--first-token",
        choices=FIRST_TOKEN_MODES,
        default="prefill",
        help="virtual runs: the client's first token from prefill, as the gateway streams it "
        "by default (docs/first-token.md), or from decode",
    )
    ap.add_argument("--jobs", type=int, default=1, help="processes")
    ap.add_argument("--out", type=Path, default=None, help="results JSONL (appended)")
    ap.add_argument("--report", type=Path, default=None, help="only print the tables of FILE")
    ap.add_argument("--served", action="store_true", help="run the points on served sims")
    ap.add_argument("--time-scale", type=float, default=0.5, help="--served: modelled s per s")
    ap.add_argument("--virtual", type=Path, default=None, help="--served: the grid's results")
    args = ap.parse_args(argv)
    if not (math.isfinite(args.time_scale) and args.time_scale > 0):
        ap.error("--time-scale must be > 0 (modelled seconds per real second)")
    if args.report:
        try:
            results = read_results(args.report)
        except ValueError as exc:
            ap.error(str(exc))
        print(report([r for r in results if "error" not in r]))
        return 0
    try:
        grid = _grid(args)
        kv_options(args.kv)
        if args.served and args.virtual:
            virtual = read_results(args.virtual)
    except ValueError as exc:
        ap.error(str(exc))
    if args.jobs < 1:
        ap.error("--jobs must be >= 1")
    out = args.out or ROOT / "logs" / "bench" / f"scorecard-{time.strftime('%Y%m%dT%H%M%S')}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if out.exists():
        for line in out.read_text().splitlines():
            r = json.loads(line)
            if "error" not in r:
                done[Point(**r["point"]).key] = r
    points = [
        Point(
            topo,
            work,
            load,
            router,
            seed,
            args.profile,
            args.duration,
            args.warmup,
            kv=args.kv if router == "kv_aware" else "",
            first_token=args.first_token,
        )
        for topo, work, load, seed, router in grid
    ]
    todo = [p for p in points if p.key not in done]
    print(f"{len(points)} points, {len(todo)} to run -> {out}", file=sys.stderr, flush=True)
    if args.served:
        served = [done[p.key] for p in points if p.key in done]
        with out.open("a") as f:
            for p in todo:
                r = run_served(p, args.time_scale, out.parent / f"{out.stem}-logs")
                f.write(json.dumps(r) + "\n")
                f.flush()
                _progress(r)
                served.append(r)
        if not args.virtual:
            virtual = []
        print(served_report(served, [v for v in virtual if "error" not in v]))
        return 0
    with out.open("a") as f:
        if args.jobs > 1:
            ctx = multiprocessing.get_context("fork")
            with ctx.Pool(args.jobs) as pool:
                stream: Iterable[dict[str, Any]] = pool.imap_unordered(_run_safe, todo)
                for r in stream:
                    f.write(json.dumps(r) + "\n")
                    f.flush()
                    _progress(r)
                    done[Point(**r["point"]).key] = r
        else:
            for p in todo:
                r = _run_safe(p)
                f.write(json.dumps(r) + "\n")
                f.flush()
                _progress(r)
                done[p.key] = r
    wanted = {p.key for p in points}
    print(report([r for k, r in done.items() if k in wanted and "error" not in r]))
    return 0


def read_results(path: Path) -> list[dict[str, Any]]:
    """The result lines of a JSONL file this script wrote. Raises ValueError (one line) for a
    file that cannot be read, holds no result, or has a line that is not one."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it ({exc})") from None
    results = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            r = None
        if not isinstance(r, dict) or not isinstance(r.get("point"), dict):
            raise ValueError(f"{path} line {n}: not a result line of this script")
        results.append(r)
    if not any("error" not in r for r in results):
        raise ValueError(f"{path}: no results in it")
    return results


def _grid(args: argparse.Namespace) -> list[tuple[str, str, float, int, str]]:
    """The (topology, workload, load, seed, router) points asked for. Raises ValueError
    naming the first bad value."""

    def names(flag: str, value: str, known: Iterable[str]) -> list[str]:
        got = [x for x in value.split(",") if x]
        bad = [x for x in got if x not in known]
        if bad or not got:
            raise ValueError(
                f"{flag}: unknown {bad[0]!r}; known: {', '.join(known)}"
                if bad
                else f"{flag}: none given"
            )
        return got

    topologies = names("--topologies", args.topologies, TOPOLOGIES)
    workloads = names("--workloads", args.workloads, wl.FAMILY)
    routers = names("--routers", args.routers, ROUTERS)
    try:
        loads = [float(x) for x in args.loads.split(",")]
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        raise ValueError("--loads takes numbers and --seeds integers, comma separated") from None
    if not all(math.isfinite(x) and x > 0 for x in loads):
        raise ValueError("--loads must be > 0 (fractions of the fleet's capacity)")
    return [
        (t, w, load, seed, r)
        for t in topologies
        for w in workloads
        for load in loads
        for seed in seeds
        for r in routers
    ]


def _progress(r: dict[str, Any]) -> None:
    p = r["point"]
    what = r.get("error") or (
        f"p50/p90/p99 {r['ttft_p50_ms']:.0f}/{r['ttft_p90_ms']:.0f}/{r['ttft_p99_ms']:.0f} ms "
        f"ITL p99 {r['itl_p99_ms']:.1f} hit {r['fleet_hit']:.0%}"
        + (
            f" lag {r['sim_lag_fraction']:.1%}"
            if "served" in r
            else f" prefill busy {r.get('prefill_busy', 0.0):.0%} cpu {r['cpu_s']:.0f}s"
        )
    )
    print(
        f"[{p['topology']} {p['workload']} {p['load']:g} s{p['seed']}] {p['router']}: {what}",
        file=sys.stderr,
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
