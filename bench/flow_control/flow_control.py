"""Flow control at the gateway: a quiet tenant beside a noisy one (fair vs FIFO, same run), and
two priorities under 2x overload. Sims, the real registry and gateways, on loopback.

    .venv/bin/python bench/flow_control/flow_control.py [--rounds 2] [--alone-s 30] [--mix-s 50]
        [--warmup-s 15] [--prio-s 50] [--slo-ms 1000] [--seed 0] [--kv-profile sims]
        [--baseline-src DIR]

Fleet (separate processes): a registry, 8 prefill sims (`--ttft-per-token-ms 0.1`: a
1000-token prompt takes 100 ms), 1 decode sim (25 ms per step, a KV cache of `--kv-blocks`
blocks of 16 tokens, 8 tokens per write) and two gateways with the scheduler embedded over the
same fleet: `--flow-policy fair` and `--flow-policy fifo`, both `--inflight-budget 0.75
--queue-timeout-s 10` with the same tenants file. With `--baseline-src DIR`, a third:
`--flow-policy fair` run from the source tree DIR (e.g. `git archive <commit> services
connector` unpacked), to compare two versions in one run. Only one gateway carries load at a
time. Requests: streamed completions of 1000 random token ids (no prefix cache hit),
`max_tokens` 64.

The gateways' kv_aware predicts each prefill's queue with `--kv-profile`: by default (`sims`)
a profile of the prefill sims' own step costs. With the scheduler's default profile
(`--kv-profile llama3-8b-h100`), which predicts a 1000-token prompt in 33 ms where the sims
take 102, a prefill is taken for idle while still busy, and a few prompts in a hundred are
sent behind another one.

1. Capacity: closed loop at twice the budget's requests on the fair gateway, completions/s.
2. Per round, for each gateway (order rotating between rounds): the quiet tenant alone at
   capacity/11 req/s (Poisson), then beside the noisy tenant at 10x its rate (1.5x capacity
   together); the quiet tenant's TTFT after `--warmup-s` of the mixed phase. Every gateway of
   a round gets the same arrival times (drawn once per round from `--seed`): the quiet
   tenant's bursts, which decide its tail, are then the same for each.
   Where the quiet tenant's TTFT goes, from the prefill sims' records of its requests (by
   X-Request-Id): `gateway` = the client's send to prefill's receipt (the gateway's flow
   queue, parsing, scheduling, the hop), `prefill` = receipt to its first token there (its
   queue behind other prompts and the prompt's step; `behind` counts the requests that waited
   more than one engine step), the rest is the way back. The KV transfer comes after the
   first token (`--first-token prefill`, the default) and is not in TTFT.
3. Priorities (fair gateway): tenant "interactive" (its key's priority 0) at 0.5x capacity
   alone, then beside "batch" (priority 10) at 1.5x (2x together): interactive's p90 TTFT
   against `--slo-ms`; batch's 429s (each checked for Retry-After), 5xx and hangs (no answer
   within 60 s) of both.

Prints one line per phase and the ratios; the shared 2-core machine inflates absolute times.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench._procs import Proc, spawn
from pdplane.launch.ports import free_port_run
from tests.support.stats import percentile

_PDPLANE = str(Path(sys.executable).parent / "pdplane")
_MODEL = "sim-model"
_PROMPT = 1000
_MAX_TOKENS = 64
_PREFILLS = 8
#: The prefill sims' step: `--itl-ms` + `--ttft-per-token-ms` x prompt tokens (ms).
_PREFILL_STEP_MS, _PREFILL_TOKEN_MS = 2.0, 0.1
_CLIENT_TIMEOUT_S = 60.0
#: The quiet tenant's requests the gateway admitted within 5 ms (its flow wait histogram).
_QUIET_WAIT = 'pdplane_gateway_flow_wait_seconds_bucket{le="0.005",priority="0",tenant="quiet"}'
_TENANTS = """
tenants:
  interactive: {priority: 0}
  batch: {priority: 10}
keys:
  - {key: sk-quiet, tenant: quiet}
  - {key: sk-noisy, tenant: noisy}
  - {key: sk-interactive, tenant: interactive}
  - {key: sk-batch, tenant: batch}
"""


#: Request ids of the quiet tenant's requests (X-Request-Id; the gateway appends its own).
_IDS = itertools.count(1)


@dataclass
class Result:
    sent: float
    ttft: float = -1.0
    status: int = 0
    retry_after: bool = False
    hung: bool = False
    request_id: str = ""
    sent_unix: float = 0.0  # time.time() at the send, to compare with the sims' records


@dataclass
class Load:
    results: dict[str, list[Result]] = field(default_factory=dict)


async def _one(session: aiohttp.ClientSession, url: str, key: str, out: Result) -> None:
    body = {
        "model": _MODEL,
        "prompt": [random.randrange(10, 30000) for _ in range(_PROMPT)],
        "max_tokens": _MAX_TOKENS,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {key}"}
    if out.request_id:
        headers["X-Request-Id"] = out.request_id
    started = time.perf_counter()
    out.sent_unix = time.time()
    try:
        async with asyncio.timeout(_CLIENT_TIMEOUT_S):
            async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
                out.status = resp.status
                out.retry_after = "retry-after" in resp.headers
                if resp.status != 200:
                    await resp.read()
                    return
                async for chunk in resp.content.iter_any():
                    if out.ttft < 0 and b'"text"' in chunk:
                        out.ttft = time.perf_counter() - started
                    if b'"error"' in chunk:
                        out.status = -1
    except TimeoutError:
        out.hung = True
    except aiohttp.ClientError:
        out.status = -2


def _arrivals(
    rng: random.Random, seconds: float, rates: dict[str, float]
) -> dict[str, list[float]]:
    """Poisson arrival times (s from the phase's start) of each key over `seconds`."""
    out: dict[str, list[float]] = {}
    for key, rate in rates.items():
        t, times = 0.0, []
        while (t := t + rng.expovariate(rate)) < seconds:
            times.append(t)
        out[key] = [0.0, *times]
    return out


async def _send_at(
    session: aiohttp.ClientSession, url: str, key: str, times: list[float], out: list[Result]
) -> None:
    start = time.perf_counter()
    tasks = []
    for at in times:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        r = Result(time.perf_counter())
        if key == "sk-quiet":
            r.request_id = f"quiet-{next(_IDS)}"
        out.append(r)
        tasks.append(asyncio.create_task(_one(session, url, key, r)))
    await asyncio.gather(*tasks)


async def _phase(url: str, arrivals: dict[str, list[float]]) -> dict[str, list[Result]]:
    """Open-loop load of several keys at once at the given arrival times; waits for every
    answer."""
    out: dict[str, list[Result]] = {k: [] for k in arrivals}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(
            *(_send_at(session, url, key, times, out[key]) for key, times in arrivals.items())
        )
    return out


async def _records(ports: list[int], clear: bool = False) -> dict[str, dict[str, Any]]:
    """The prefill sims' records of the quiet tenant's requests by its X-Request-Id
    (`quiet-<n>`; the gateway sends `quiet-<n>-<its own id>`); with `clear`, forgets them
    instead."""
    found: dict[str, dict[str, Any]] = {}
    async with aiohttp.ClientSession() as session:
        for port in ports:
            url = f"http://127.0.0.1:{port}/sim/requests"
            if clear:
                async with session.delete(url) as resp:
                    resp.raise_for_status()
                continue
            async with session.get(url) as resp:
                for record in (await resp.json())["requests"]:
                    rid = record["request_id"]
                    if rid.startswith("quiet-") and record["first_token_at"]:
                        found["-".join(rid.split("-", 2)[:2])] = record
    return found


def _where(results: list[Result], records: dict[str, dict[str, Any]], after: float = 0.0) -> str:
    """The quiet tenant's TTFT split at prefill (module docstring), p50/p90 of each part."""
    gateway, prefill, back, behind = [], [], [], 0
    for r in results:
        rec = records.get(r.request_id)
        if rec is None or r.status != 200 or r.ttft < 0 or r.sent < after:
            continue
        gateway.append(rec["received_at"] - r.sent_unix)
        prefill.append(rec["first_token_at"] - rec["received_at"])
        back.append(r.ttft - gateway[-1] - prefill[-1])
        behind += rec["first_token_step"] - rec["queued_step"] > 1
    parts = ", ".join(
        f"{name} {_p(v, 0.5):.0f}/{_p(v, 0.9):.0f}"
        for name, v in (("gateway", gateway), ("prefill", prefill), ("back", back))
    )
    return f"{parts} ms (p50/p90; behind another prompt {behind}/{len(prefill)})"


async def _capacity(url: str, concurrency: int, seconds: float) -> float:
    """Completions per second of a closed loop at `concurrency` (after 5 s of warm-up)."""
    done: list[float] = []
    until = time.perf_counter() + seconds + 5

    async def worker(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < until:
            r = Result(time.perf_counter())
            await _one(session, url, "sk-noisy", r)
            if r.status == 200:
                done.append(time.perf_counter())

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    start = until - seconds
    return sum(1 for t in done if t >= start) / seconds


def _ttfts(results: list[Result], after: float = 0.0) -> list[float]:
    return [r.ttft for r in results if r.status == 200 and r.ttft >= 0 and r.sent >= after]


def _p(values: list[float], q: float) -> float:
    return percentile(values, q * 100) * 1000 if values else float("nan")


async def _metric(url: str, prefix: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.split()[1])
    return float("nan")


async def _idle(url: str) -> None:
    """Waits (up to 60 s) until the gateway has no request in flight."""
    for _ in range(600):
        if await _metric(url, "pdplane_gateway_inflight_requests ") == 0:
            return
        await asyncio.sleep(0.1)


def _start(
    args: argparse.Namespace, logs: Path, tenants: Path
) -> tuple[list[Proc], dict[str, str], list[int]]:
    procs: list[Proc] = []
    reg = free_port_run()
    registry = f"127.0.0.1:{reg}"
    procs.append(
        spawn(
            "registry",
            [_PDPLANE, "registry", "--port", str(reg), "--heartbeat-interval-ms", "200"],
            "",
            logs,
        )
    )
    time.sleep(1.0)
    common = [
        "--registry",
        registry,
        "--block-size",
        "16",
        "--max-model-len",
        "4096",
        "--no-kv-events",
    ]
    prefill_port = free_port_run(_PREFILLS)  # the instances take consecutive ports
    procs.append(
        spawn(
            "prefill",
            [_PDPLANE, "sim", "--role", "prefill", "--instances", str(_PREFILLS),
             "--port", str(prefill_port), "--ttft-per-token-ms", str(_PREFILL_TOKEN_MS),
             "--itl-ms", str(_PREFILL_STEP_MS),
             "--kv-blocks", "20000", *common],
            "",
            logs,
        )
    )  # fmt: skip
    procs.append(
        spawn(
            "decode",
            [_PDPLANE, "sim", "--role", "decode", "--port", str(free_port_run()), "--itl-ms", "25",
             "--stream-interval", "8",
             "--kv-blocks", str(args.kv_blocks), *common],
            "",
            logs,
        )
    )  # fmt: skip
    profile = logs / "prefill-sims.json" if args.kv_profile == "sims" else args.kv_profile
    if isinstance(profile, Path):
        profile.write_text(
            json.dumps(
                {
                    "name": "flow-bench-prefill-sims",
                    "description": "the prefill sims' step costs",
                    "cost": {
                        "weights_ms": _PREFILL_STEP_MS,
                        "prefill_token_ms": _PREFILL_TOKEN_MS,
                    },
                    "max_num_batched_tokens": 8192,  # the sims' default
                }
            )
        )
    urls = {}
    gateways: list[tuple[str, str, str | None]] = [("fair", "fair", None), ("fifo", "fifo", None)]
    if args.baseline_src:
        src = Path(args.baseline_src).resolve()
        gateways.append(("fair-baseline", "fair", f"{src / 'services'}:{src / 'connector'}"))
    for name, policy, pythonpath in gateways:
        port = free_port_run()
        procs.append(
            spawn(
                f"gateway-{name}",
                [_PDPLANE, "gateway", "--scheduler", "embedded", "--registry", registry,
                 "--port", str(port), "--flow-policy", policy, "--inflight-budget", "0.75",
                 "--queue-timeout-s", "10", "--tenants", str(tenants), "--no-access-log",
                 "--log-level", "warning", "--kv-profile", str(profile)],
                "",
                logs,
                env={"PYTHONPATH": pythonpath} if pythonpath else None,
            )
        )  # fmt: skip
        urls[name] = f"http://127.0.0.1:{port}"
    return procs, urls, [prefill_port + i for i in range(_PREFILLS)]


async def _ready(urls: dict[str, str]) -> None:
    async with aiohttp.ClientSession() as session:
        for url in urls.values():
            for _ in range(1200):  # start-up on a loaded 2-core machine can take a minute
                try:
                    async with session.get(f"{url}/health") as resp:
                        body = await resp.json()
                        if resp.status == 200 and body["models"][_MODEL]["prefill"] == _PREFILLS:
                            break
                except (aiohttp.ClientError, KeyError):
                    pass
                await asyncio.sleep(0.1)
            else:
                raise RuntimeError(f"{url} not ready")
    await asyncio.sleep(1.5)  # the decode's load report (its KV cache: the budget) arrives


async def _main(args: argparse.Namespace) -> None:
    logs = Path(tempfile.mkdtemp(prefix="pdplane-flow-bench-"))
    tenants = logs / "tenants.yaml"
    tenants.write_text(_TENANTS)
    procs, urls, prefill_ports = _start(args, logs, tenants)
    try:
        await _ready(urls)
        budget_requests = int(args.kv_blocks * 16 * 0.75 // (_PROMPT + _MAX_TOKENS))
        cap = await _capacity(urls["fair"], 2 * budget_requests, args.capacity_s)
        budget = await _metric(urls["fair"], "pdplane_gateway_flow_budget_tokens{")
        print(
            f"fleet: {_PREFILLS} prefill sims, 1 decode sim ({args.kv_blocks} KV blocks x 16), "
            f"budget 0.75 x KV = {budget:.0f} tokens ({budget_requests} requests of {_PROMPT}+"
            f"{_MAX_TOKENS} tokens); "
            f"measured capacity {cap:.2f} req/s (closed loop, {2 * budget_requests} at a time)",
            flush=True,
        )
        await _idle(urls["fair"])
        quiet_rate, noisy_rate = 1.5 * cap / 11, 1.5 * cap * 10 / 11
        names = list(urls)
        pooled: dict[tuple[str, str], list[float]] = {}
        statuses: dict[str, dict[int, int]] = {}
        for rnd in range(args.rounds):
            rng = random.Random(args.seed * 1000 + rnd)
            alone_at = _arrivals(rng, args.alone_s, {"sk-quiet": quiet_rate})
            mixed_at = _arrivals(rng, args.mix_s, {"sk-quiet": quiet_rate, "sk-noisy": noisy_rate})
            for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                url = urls[name]
                await _records(prefill_ports, clear=True)
                alone = await _phase(url, alone_at)
                await _idle(url)
                where_alone = _where(alone["sk-quiet"], await _records(prefill_ports))
                await _records(prefill_ports, clear=True)
                quiet_wait = _QUIET_WAIT
                quiet_all = 'pdplane_gateway_flow_wait_seconds_count{priority="0",tenant="quiet"}'
                before = (await _metric(url, quiet_wait), await _metric(url, quiet_all))
                t0 = time.perf_counter()
                mixed = await _phase(url, mixed_at)
                await _idle(url)
                a = _ttfts(alone["sk-quiet"])
                m = _ttfts(mixed["sk-quiet"], t0 + args.warmup_s)
                where_mixed = _where(
                    mixed["sk-quiet"], await _records(prefill_ports), t0 + args.warmup_s
                )
                prompt = (await _metric(url, quiet_wait)) - before[0]
                admitted = (await _metric(url, quiet_all)) - before[1]
                pooled.setdefault((name, "alone"), []).extend(a)
                pooled.setdefault((name, "mixed"), []).extend(m)
                for key in ("sk-quiet", "sk-noisy"):
                    counts = statuses.setdefault(f"{name} {key}", {})
                    for r in mixed[key]:
                        s = -3 if r.hung else r.status
                        counts[s] = counts.get(s, 0) + 1
                print(
                    f"round {rnd + 1} {name}: quiet alone p50/p90 {_p(a, 0.5):.0f}/"
                    f"{_p(a, 0.9):.0f} ms (n={len(a)}); beside noisy p50/p90 {_p(m, 0.5):.0f}/"
                    f"{_p(m, 0.9):.0f} ms (n={len(m)}); p90 ratio {_p(m, 0.9) / _p(a, 0.9):.2f}; "
                    f"quiet admitted by the gateway within 5 ms: {prompt:.0f}/{admitted:.0f}\n"
                    f"    quiet's TTFT alone: {where_alone}\n"
                    f"    quiet's TTFT beside noisy: {where_mixed}",
                    flush=True,
                )
        for name in names if args.rounds else ():
            a, m = pooled[(name, "alone")], pooled[(name, "mixed")]
            print(
                f"all rounds {name}: quiet p90 TTFT alone {_p(a, 0.9):.0f} ms, beside noisy "
                f"{_p(m, 0.9):.0f} ms: ratio {_p(m, 0.9) / _p(a, 0.9):.2f}; statuses "
                f"quiet {statuses[f'{name} sk-quiet']} noisy {statuses[f'{name} sk-noisy']}",
                flush=True,
            )
        # Priorities under 2x overload, fair gateway.
        url = urls["fair"]
        rng = random.Random(args.seed * 1000 - 1)
        alone = await _phase(url, _arrivals(rng, args.alone_s, {"sk-interactive": 0.5 * cap}))
        await _idle(url)
        t0 = time.perf_counter()
        mixed = await _phase(
            url,
            _arrivals(rng, args.prio_s, {"sk-interactive": 0.5 * cap, "sk-batch": 1.5 * cap}),
        )
        await _idle(url)
        a = _ttfts(alone["sk-interactive"])
        m = _ttfts(mixed["sk-interactive"], t0 + args.warmup_s)
        everything = [r for rs in mixed.values() for r in rs]
        batch = mixed["sk-batch"]
        shed = [r for r in batch if r.status == 429]
        print(
            f"priorities (2x overload: interactive 0.5x + batch 1.5x capacity, {args.prio_s:g} s): "
            f"interactive p50/p90 TTFT alone {_p(a, 0.5):.0f}/{_p(a, 0.9):.0f} ms, under "
            f"overload {_p(m, 0.5):.0f}/{_p(m, 0.9):.0f} ms (SLO p90 {args.slo_ms:g} ms: "
            f"{'met' if _p(m, 0.9) <= args.slo_ms else 'MISSED'}); interactive 200 "
            f"{sum(r.status == 200 for r in mixed['sk-interactive'])}/"
            f"{len(mixed['sk-interactive'])}; batch 200 {sum(r.status == 200 for r in batch)}, "
            f"429 {len(shed)} (with Retry-After {sum(r.retry_after for r in shed)}); 5xx "
            f"{sum(r.status >= 500 for r in everything)}, errors "
            f"{sum(r.status < 0 for r in everything)}, hangs {sum(r.hung for r in everything)}",
            flush=True,
        )
    finally:
        for p in reversed(procs):
            p.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="0 = the priorities only")
    parser.add_argument("--alone-s", type=float, default=30.0)
    parser.add_argument("--mix-s", type=float, default=50.0)
    parser.add_argument("--warmup-s", type=float, default=15.0)
    parser.add_argument("--prio-s", type=float, default=50.0)
    parser.add_argument("--capacity-s", type=float, default=15.0)
    parser.add_argument("--kv-blocks", type=int, default=1300)
    parser.add_argument("--slo-ms", type=float, default=1000.0)
    parser.add_argument("--seed", type=int, default=0, help="of the arrival times and prompts")
    parser.add_argument(
        "--kv-profile",
        default="sims",
        help="the gateways' --kv-profile: 'sims' (default) = a profile of the prefill sims' "
        "step costs, else a built-in name (the scheduler's default: llama3-8b-h100) or a file",
    )
    parser.add_argument(
        "--baseline-src",
        help="a source tree (with services/ and connector/) to run a third gateway from, "
        "--flow-policy fair, beside the two of this tree",
    )
    args = parser.parse_args()
    random.seed(args.seed)
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
