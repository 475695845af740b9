"""Where a disaggregated request's TTFT goes, from its OpenTelemetry spans (real vLLM CPU, 1P1D).

    .venv/bin/python bench/vllm_cpu/ttft_breakdown.py [--runs 10] [--prompt-tokens 128 512 2048]
        [--ab dispatch-mode|first-token] [--plain-prefill] [--fresh-ab]

Starts `pdplane up`'s stack (registry, scheduler, gateway, prefill, decode) with traces on
(`OTEL_EXPORTER_OTLP_ENDPOINT` pointed at an OTLP receiver in this process) plus one plain vLLM
instance with the same flags, then sends fresh prompts (token ids: the count is exact; fresh:
no prefix cache answers), streamed, one request at a time, to both, each through a persistent
client (one keep-alive connection per target: neither TTFT carries connection set-up;
`--fresh-ab` also measures a new client per request, side by side). Per prompt length it prints
the median of each phase (ms) from the spans of each disaggregated request, and goal G3.5:

    floor = prefill alone (TTFT of the plain instance) + KV transfer (`pdplane.kv_pull`)
            + one decode step (median inter-token gap of the plain instance)
    ratio = disaggregated TTFT (client-measured) / floor         G3.5: ratio <= 1.2

`--ab dispatch-mode` runs the stack four times in one run, the same prompts each: sequential
or concurrent dispatch (`PDPLANE_DISPATCH`) x pull or push KV (`"mode"` of both instances'
`kv_connector_extra_config`), each with its own plain instance, then a summary. A push stack's
`pdplane.kv_pull` is decode's copy out of its receive buffer, so its ratio is also given
against the floor with the pull stack's transfer. `--ab first-token` runs the stack with the
first output token from prefill (the gateway's default, `PDPLANE_FIRST_TOKEN=prefill`) and from
decode, the same prompts each; "client: 2nd token" shows where the transfer went (the gap
between the first and second token). `--plain-prefill` also times a prefill-shaped
request (non-streamed, 1 token) on the plain instance.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import httpx

from pdplane.launch.deployment import Fleet, FleetSpec
from pdplane.launch.ports import free_port_run
from pdplane.launch.vllm_cpu import VllmCpuInstance, VllmCpuOptions
from tests.support.otlp import OtlpReceiver, ReceivedSpan, otlp_receiver

__all__ = ["PHASES", "Stack", "breakdown", "running_stack", "timed_stream"]

VOCAB = 2048
#: The phases of one request, in order, as printed (ms).
PHASES = (
    "client TTFT",
    "client: 2nd token",
    "gateway in (arrival -> Schedule)",
    "schedule",
    "  scheduler decision",
    "prefill leg",
    "  prefill vLLM TTFT",
    "  leg start -> prefill vLLM arrival",
    "  prefill vLLM end -> answer at gateway",
    "between legs (gateway)",
    "decode leg (send -> headers)",
    "  of it after prefill's answer",
    "decode admission (arrival -> pull start)",
    "KV transfer (kv_pull)",
    "  prefill kv_serve",
    "pull end -> first byte at gateway",
    "  decode vLLM queue (incl. KV wait)",
    "relay (gateway first byte -> client)",
    "decode side (prefill's answer -> first byte)",
)
#: The row of `--plain-prefill`.
PLAIN_PREFILL = "plain: non-streamed 1-token answer (client)"


@dataclass
class Stack:
    """The running stack: gateway URL, plain instance URL, served model, span receiver."""

    gateway: str
    single: str
    model: str
    receiver: OtlpReceiver


@contextmanager
def running_stack(
    log_dir: Path,
    max_model_len: int,
    single: bool = True,
    connector_extra: dict[str, object] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[Stack]:
    """`pdplane up`'s stack with traces on, plus (`single`) one plain vLLM instance without
    connector or traces (`Stack.single` is "" without it). `connector_extra`: more
    `kv_connector_extra_config` keys of the P/D instances (e.g. `{"mode": "push"}`); `env`:
    more environment of the stack's processes (e.g. `PDPLANE_DISPATCH` of the gateway),
    restored afterwards."""
    with (
        mock.patch.dict(os.environ, env or {}),
        _stack(log_dir, max_model_len, single, connector_extra or {}) as stack,
    ):
        yield stack


@contextmanager
def _stack(
    log_dir: Path, max_model_len: int, single: bool, connector_extra: dict[str, object]
) -> Iterator[Stack]:
    with otlp_receiver() as receiver:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"  # ms: spans arrive soon after a request
        spec = FleetSpec(
            gateway_port=free_port_run(),
            registry_port=free_port_run(),
            scheduler_port=free_port_run(),
            vllm_base_port=free_port_run(2),
            kv_base_port=free_port_run(2),
            log_dir=log_dir,
            max_model_len=max_model_len,
            vllm_options={"connector_extra": connector_extra} if connector_extra else {},
        )
        fleet = Fleet(spec, say=lambda m: print(f"  {m}", flush=True))
        plain: VllmCpuInstance | None = None
        try:
            fleet.start()
            assert fleet.model_dir is not None
            if not single:
                yield Stack(fleet.gateway_url, "", fleet.model_name, receiver)
                return
            plain = VllmCpuInstance(
                VllmCpuOptions(
                    model=fleet.model_dir,
                    port=free_port_run(),
                    served_model_name=fleet.model_name,
                    max_model_len=max_model_len,
                    omp_threads_bind="1",
                ),
                log_dir / "single.log",
                base_env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
            )
            plain.start()
            plain.wait_healthy(300)
            yield Stack(fleet.gateway_url, plain.url, fleet.model_name, receiver)
        finally:
            if plain is not None:
                plain.stop()
            fleet.stop()
            os.environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)


def timed_stream(
    url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    headers: dict[str, str] | None = None,
    client: httpx.Client | None = None,
) -> tuple[float, list[float]]:
    """(TTFT ms, inter-token gaps ms) of one streamed completion, as the client sees them.

    `client`: a persistent client (its keep-alive connection is reused); None = a new client
    and connection for this request, whose set-up (httpx builds an SSL context per client,
    ~20 ms here, even for plain HTTP) lands inside the measured TTFT."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    stamps: list[float] = []
    stream = (
        client.stream("POST", f"{url}/v1/completions", json=body, headers=headers)
        if client is not None
        else httpx.stream(
            "POST", f"{url}/v1/completions", json=body, headers=headers, timeout=300.0
        )
    )
    with stream as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                stamps.append(time.perf_counter())
    ttft = (stamps[0] - start) * 1000
    return ttft, [(b - a) * 1000 for a, b in itertools.pairwise(stamps)]


def timed_answer(url: str, model: str, prompt: list[int], client: httpx.Client) -> float:
    """ms until the whole non-streamed answer of a prefill-shaped request (1 token, no
    stream, as the gateway's prefill leg sends it) has arrived, as the client sees it."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": False}
    start = time.perf_counter()
    r = client.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    return (time.perf_counter() - start) * 1000


def _trace_complete(trace_id: str, push: bool = False) -> Callable[[list[ReceivedSpan]], bool]:
    # Push mode: decode takes the blocks from its receive buffer, so no pull is served.
    # Every span `breakdown` reads; they come from four processes, each exporting on its own.
    needed = {
        "pdplane.request",
        "pdplane.schedule",
        "pdplane.scheduler.decision",
        "pdplane.prefill_leg",
        "pdplane.decode_leg",
        "pdplane.first_byte",
        "pdplane.kv_pull",
        "llm_request",
    }
    if not push:
        needed.add("pdplane.kv_serve")

    def done(spans: list[ReceivedSpan]) -> bool:
        got = [s for s in spans if s.trace_id == trace_id]
        names = {s.name for s in got}
        return needed <= names and sum(s.name == "llm_request" for s in got) >= 2

    return done


def breakdown(
    spans: list[ReceivedSpan], client_ttft_ms: float, client_second_ms: float = math.nan
) -> dict[str, float]:
    """The phases (ms) of one request's trace (`spans` all of one trace id; the client's TTFT and
    time to its second token alongside); NaN for a span
    the mode does not have (no `pdplane.kv_serve` after a push; no gap between the legs with
    concurrent dispatch, where the decode leg opens before prefill answers)."""
    by = {s.name: s for s in spans if s.name != "llm_request"}
    legs = {by["pdplane.prefill_leg"].span_id: "prefill", by["pdplane.decode_leg"].span_id: "d"}
    vllm = {legs[s.parent_id]: s for s in spans if s.name == "llm_request" and s.parent_id in legs}
    root, sched = by["pdplane.request"], by["pdplane.schedule"]
    pleg, dleg, pull = by["pdplane.prefill_leg"], by["pdplane.decode_leg"], by["pdplane.kv_pull"]
    first = by["pdplane.first_byte"]
    gateway_ttft = (first.end_ns - root.start_ns) / 1e6

    def ms(a: int, b: int) -> float:
        return (b - a) / 1e6

    concurrent = dleg.start_ns < pleg.end_ns
    serve = by.get("pdplane.kv_serve")

    return {
        "client TTFT": client_ttft_ms,
        "client: 2nd token": client_second_ms,
        "gateway in (arrival -> Schedule)": ms(root.start_ns, sched.start_ns),
        "schedule": sched.ms,
        "  scheduler decision": by["pdplane.scheduler.decision"].ms,
        "prefill leg": pleg.ms,
        "  prefill vLLM TTFT": 1000
        * float(vllm["prefill"].attributes.get("gen_ai.latency.time_to_first_token", 0.0)),
        # The prefill leg around vLLM's own request span (`llm_request`: arrival -> finish).
        "  leg start -> prefill vLLM arrival": ms(pleg.start_ns, vllm["prefill"].start_ns),
        "  prefill vLLM end -> answer at gateway": ms(vllm["prefill"].end_ns, pleg.end_ns),
        "between legs (gateway)": math.nan if concurrent else ms(pleg.end_ns, dleg.start_ns),
        "decode leg (send -> headers)": dleg.ms,
        "  of it after prefill's answer": ms(max(pleg.end_ns, dleg.start_ns), dleg.end_ns),
        "decode admission (arrival -> pull start)": ms(vllm["d"].start_ns, pull.start_ns),
        "KV transfer (kv_pull)": pull.ms,
        "  prefill kv_serve": serve.ms if serve is not None else math.nan,
        "pull end -> first byte at gateway": ms(pull.end_ns, first.end_ns),
        "  decode vLLM queue (incl. KV wait)": 1000
        * float(vllm["d"].attributes.get("gen_ai.latency.time_in_queue", 0.0)),
        "relay (gateway first byte -> client)": client_ttft_ms - gateway_ttft,
        # What follows prefill on the critical path in every mode: the decode leg's rest,
        # admission, the load (pull or copy of a push) and decode's first token.
        "decode side (prefill's answer -> first byte)": ms(pleg.end_ns, first.end_ns),
    }


def _first_token_counts(gateway: str) -> dict[str, float]:
    """The gateway's `pdplane_gateway_first_tokens_total` by source (prefill, decode)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{gateway}/metrics", timeout=10).text.splitlines():
        m = re.match(r'pdplane_gateway_first_tokens_total\{source="(\w+)"\} (\S+)', line)
        if m:
            out[m[1]] = float(m[2])
    return out


def measure(
    stack: Stack,
    prompt_tokens: int,
    runs: int,
    rng: random.Random,
    fresh_ab: bool = False,
    push: bool = False,
    plain_prefill: bool = False,
) -> tuple[dict[str, float], dict[str, float]]:
    """Medians of the phases (ms) and of the floor's parts over `runs` fresh prompts.
    `plain_prefill` also sends another fresh prompt per run to the plain instance shaped like
    the prefill leg (non-streamed, 1 token) and adds the median of its answer time as a row.

    Both targets are reached through persistent clients (one keep-alive connection each), so
    neither TTFT carries the client's connection set-up. `fresh_ab` also sends, interleaved,
    `runs` other fresh prompts to both with a new client per request (the bench's earlier
    client) and adds their medians as "fresh connection" rows."""
    phases: dict[str, list[float]] = defaultdict(list)
    single_ttft: list[float] = []
    single_step: list[float] = []
    fresh: dict[str, list[float]] = defaultdict(list)
    # PDPLANE_BENCH_PER_REQUEST=1: each request's numbers and where its first token came from
    # (the gateway's pdplane_gateway_first_tokens_total, read between requests)
    per_request = bool(os.environ.get("PDPLANE_BENCH_PER_REQUEST"))
    with httpx.Client(timeout=300.0) as to_gateway, httpx.Client(timeout=300.0) as to_single:
        for i in range(runs + 1):  # the first of each length warms both paths, not counted
            prompt = [rng.randrange(8, VOCAB) for _ in range(prompt_tokens)]
            trace_id = os.urandom(16).hex()
            tp = {"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"}
            before = _first_token_counts(stack.gateway) if per_request else {}
            ttft, g_gaps = timed_stream(stack.gateway, stack.model, prompt, 4, tp, to_gateway)
            if per_request:
                after = _first_token_counts(stack.gateway)
                source = next((k for k in after if after[k] > before.get(k, 0.0)), "-")
            s_ttft, gaps = timed_stream(stack.single, stack.model, prompt, 8, None, to_single)
            spans = stack.receiver.wait_for(_trace_complete(trace_id, push), timeout_s=30)
            if fresh_ab:
                other = [rng.randrange(8, VOCAB) for _ in range(prompt_tokens)]
                f_ttft, _ = timed_stream(stack.gateway, stack.model, other, 4)
                f_single, _ = timed_stream(stack.single, stack.model, other, 8)
            if plain_prefill:
                other = [rng.randrange(8, VOCAB) for _ in range(prompt_tokens)]
                fresh["plain prefill-shaped"].append(
                    timed_answer(stack.single, stack.model, other, to_single)
                )
            if i == 0:
                continue
            mine = [s for s in spans if s.trace_id == trace_id]
            parts = breakdown(mine, ttft, ttft + g_gaps[0])
            for k, v in parts.items():
                phases[k].append(v)
            if per_request:  # one line per request, to stderr
                print(
                    f"  {prompt_tokens} tokens #{i}: client TTFT {ttft:.1f} ms, single "
                    f"{s_ttft:.1f}, prefill leg {parts['prefill leg']:.1f}, 2nd token "
                    f"{ttft + g_gaps[0]:.1f}, first token from {source}",
                    file=sys.stderr,
                )
            single_ttft.append(s_ttft)
            single_step.extend(gaps)
            if fresh_ab:
                fresh["client TTFT"].append(f_ttft)
                fresh["prefill alone"].append(f_single)
    med = {k: median_present(v) for k, v in phases.items()}
    floor = {
        "prefill alone (single TTFT)": statistics.median(single_ttft),
        "KV transfer": med["KV transfer (kv_pull)"],
        "one decode step (single ITL)": statistics.median(single_step),
    }
    if plain_prefill:
        med[PLAIN_PREFILL] = statistics.median(fresh["plain prefill-shaped"][1:])
    if fresh_ab:
        f_ttft, f_single = (statistics.median(fresh[k]) for k in ("client TTFT", "prefill alone"))
        f_floor = f_single + floor["KV transfer"] + floor["one decode step (single ITL)"]
        med["fresh connection: client TTFT"] = f_ttft
        med["fresh connection: prefill alone"] = f_single
        med["fresh connection: ratio TTFT / floor"] = f_ttft / f_floor
    return med, floor


def median_present(values: list[float]) -> float:
    """Median of the values that exist (NaN = the span is not in this mode); NaN if none."""
    present = [v for v in values if not math.isnan(v)]
    return statistics.median(present) if present else math.nan


#: Per prompt length: (phase medians, the floor's parts), ms.
Results = dict[int, tuple[dict[str, float], dict[str, float]]]


@dataclass
class Variant:
    """One stack of an A/B: its label, more `kv_connector_extra_config` keys of the P/D
    instances, more environment of the stack's processes."""

    label: str
    connector_extra: dict[str, object]
    env: dict[str, str]


#: --ab NAME: the stacks it runs, one after the other, the default first.
VARIANTS: dict[str, list[Variant]] = {
    "dispatch-mode": [
        Variant("A: sequential + pull (default)", {}, {"PDPLANE_DISPATCH": "sequential"}),
        Variant("B: concurrent + pull", {}, {"PDPLANE_DISPATCH": "concurrent"}),
        Variant("C: sequential + push", {"mode": "push"}, {"PDPLANE_DISPATCH": "sequential"}),
        Variant("D: concurrent + push", {"mode": "push"}, {"PDPLANE_DISPATCH": "concurrent"}),
    ],
    "first-token": [
        Variant("A: first token from prefill (default)", {}, {"PDPLANE_FIRST_TOKEN": "prefill"}),
        Variant("B: first token from decode", {}, {"PDPLANE_FIRST_TOKEN": "decode"}),
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fresh-ab",
        action="store_true",
        help="also measure with a new client connection per request (A/B of the client)",
    )
    parser.add_argument(
        "--plain-prefill",
        action="store_true",
        help="also time a prefill-shaped request (non-streamed, 1 token) on the plain instance",
    )
    parser.add_argument(
        "--ab",
        choices=sorted(VARIANTS),
        help="A/B: run the stack once per variant in this run (the default first), the same "
        "prompts each, and print each one's table and a summary",
    )
    args = parser.parse_args()
    max_model_len = max(1024, max(args.prompt_tokens) + 64)
    variants = VARIANTS[args.ab] if args.ab else [Variant("", {}, {})]
    measured: list[tuple[Variant, Results, str]] = []
    for v in variants:
        logs = Path(tempfile.mkdtemp(prefix="ttft-breakdown-"))
        rng = random.Random(args.seed)  # the same prompts for every variant
        push = v.connector_extra.get("mode") == "push"
        results: Results = {}
        with running_stack(logs, max_model_len, True, v.connector_extra, v.env) as stack:
            print(f"stack ready{' (' + v.label + ')' if v.label else ''} (logs {logs})", flush=True)
            for n in args.prompt_tokens:
                results[n] = measure(
                    stack, n, args.runs, rng, args.fresh_ab, push, args.plain_prefill
                )
        measured.append((v, results, _load_sources(logs)))
        _report(args, results, v.label, measured[-1][2] if push else "")
    if len(measured) > 1:
        _summary(args.prompt_tokens, measured)


def _load_sources(log_dir: Path) -> str:
    """How decode got the KV over the stack's life, from its connector's log lines
    ("transfer <id>: took pushed ..." / "transfer <id>: pulled ..."), warm-up requests
    included."""
    text = "".join(f.read_text(errors="replace") for f in sorted(log_dir.glob("decode*.log")))
    pushed = len(re.findall(r"transfer \S+: took pushed", text))
    pulled = len(re.findall(r"transfer \S+: pulled", text))
    return f"{pushed} taken from a push, {pulled} pulled"


def _fmt(value: float, spec: str = ".1f") -> str:
    return f"{'-':>10}" if math.isnan(value) else f"{value:>10{spec}}"


def _report(args: argparse.Namespace, results: Results, label: str, sources: str) -> None:
    sizes = args.prompt_tokens
    if label:
        print(f"\n== {label}")
    print(f"\nTTFT breakdown, median of {args.runs} requests each, one at a time (ms)")
    print(f"{'phase':<44}" + "".join(f"{n:>10}" for n in sizes))
    for phase in PHASES:
        print(f"{phase:<44}" + "".join(_fmt(results[n][0][phase]) for n in sizes))
    print()
    for part in next(iter(results.values()))[1]:
        print(f"{'floor: ' + part:<44}" + "".join(_fmt(results[n][1][part]) for n in sizes))
    floors = {n: sum(results[n][1].values()) for n in sizes}
    print(f"{'floor':<44}" + "".join(_fmt(floors[n]) for n in sizes))
    ratios = {n: results[n][0]["client TTFT"] / floors[n] for n in sizes}
    label = "G3.5 ratio TTFT / floor (goal <= 1.2)"
    print(f"{label:<44}" + "".join(_fmt(ratios[n], ".2f") for n in sizes))
    if args.plain_prefill:
        print(f"{PLAIN_PREFILL:<44}" + "".join(_fmt(results[n][0][PLAIN_PREFILL]) for n in sizes))
    if sources:
        print(f"decode's KV loads: {sources}")
    if args.fresh_ab:
        print()
        for row in [k for k in results[sizes[0]][0] if k.startswith("fresh connection")]:
            fmt = ".2f" if "ratio" in row else ".1f"
            print(f"{row:<44}" + "".join(_fmt(results[n][0][row], fmt) for n in sizes))


def _summary(sizes: list[int], measured: list[tuple[Variant, Results, str]]) -> None:
    """Per variant: client TTFT and the G3.5 ratio. A push stack's own `kv_pull` is the copy
    out of its receive buffer, not a transfer, so its ratio also uses the floor with the first
    (pull) stack's KV transfer at that length, measured in this run (the floor as defined);
    its ratio against its own parts follows in brackets."""
    base = measured[0][1]
    print("\nsummary: client TTFT ms / G3.5 ratio (floor with the pull stack's KV transfer)")
    print(f"{'variant':<44}" + "".join(f"{n:>22}" for n in sizes))
    for v, results, _ in measured:
        cells = []
        for n in sizes:
            med, parts = results[n]
            own = sum(parts.values())
            cell = f"{med['client TTFT']:.1f} / {med['client TTFT'] / own:.2f}"
            if v.connector_extra.get("mode") == "push":
                floor = own - parts["KV transfer"] + base[n][1]["KV transfer"]
                cell = f"{med['client TTFT']:.1f} / {med['client TTFT'] / floor:.2f}"
                cell += f" ({med['client TTFT'] / own:.2f})"
            cells.append(f" {cell:>21}")
        print(f"{v.label:<44}" + "".join(cells))


if __name__ == "__main__":
    main()
