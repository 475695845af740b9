"""`vllm bench serve` against pdplane (gateway -> 1P1D) and against one plain vLLM instance with
the same flags, side by side in one run, on real vLLM CPU instances.

    .venv/bin/python bench/vllm_cpu/vllm_bench.py [--num-prompts 32] [--input-len 256]
        [--output-len 32] [--max-concurrency 1,4] [--url http://127.0.0.1:8000]
        [--ab dispatch-mode|first-token]

Starts `pdplane up`'s stack on free ports plus a reference instance (or, with `--url`, measures
an already running gateway alone), then runs the environment's `vllm bench serve` (random
dataset, fixed seed: the same prompts for both targets; no `--model`, so vLLM's client takes the
model and its tokenizer from /v1/models as against `vllm serve`) for every concurrency, first on
the gateway, then on the single instance. Prints each run's own result table, then one line per
metric with the ratio pdplane / single instance.

`--ab dispatch-mode` (or `first-token`) instead runs the stack once per variant of
`bench/vllm_cpu/ttft_breakdown.py` (sequential or concurrent dispatch x pull or push KV; the
first token from prefill or from decode), one after the other, the same prompts each, without a
reference instance, and prints per metric a variant x concurrency table with the ratio to the
first variant (the defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

from bench.vllm_cpu.ttft_breakdown import VARIANTS, Variant
from pdplane.launch.deployment import Fleet, FleetSpec
from pdplane.launch.ports import free_port_run
from pdplane.launch.vllm_cpu import VllmCpuInstance, VllmCpuOptions

_METRICS = (
    ("request_throughput", "requests/s"),
    ("output_throughput", "output tok/s"),
    ("mean_ttft_ms", "mean TTFT ms"),
    ("median_ttft_ms", "median TTFT ms"),
    ("p99_ttft_ms", "p99 TTFT ms"),
    ("mean_tpot_ms", "mean TPOT ms"),
    ("median_itl_ms", "median ITL ms"),
)


def _vllm() -> list[str]:
    """The environment's `vllm` command (bin/ next to this interpreter, else on PATH)."""
    local = Path(sys.executable).with_name("vllm")
    found = str(local) if local.exists() else shutil.which("vllm")
    return [found] if found else [sys.executable, "-m", "pdplane.cli.vllm_console"]


def bench_serve(url: str, args: argparse.Namespace, concurrency: int, out: Path) -> dict[str, Any]:
    """Runs `vllm bench serve` against `url`, prints its output, returns its result JSON."""
    name = f"{out.stem}-c{concurrency}.json"
    argv = [
        *_vllm(),
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--ignore-eos",
        "--num-prompts",
        str(args.num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--seed",
        str(args.seed),
        "--save-result",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        name,
    ]
    print(f"$ {' '.join(argv)}", flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    table = run.stdout[run.stdout.find("============ Serving Benchmark Result") :]
    print(table or run.stdout[-3000:] + run.stderr[-3000:], flush=True)
    if run.returncode != 0:
        raise SystemExit(f"vllm bench serve failed with status {run.returncode}")
    result: dict[str, Any] = json.loads((out.parent / name).read_text())
    return result


def _spec(args: argparse.Namespace, log_dir: Path, connector_extra: dict[str, object]) -> FleetSpec:
    return FleetSpec(
        gateway_port=free_port_run(),
        registry_port=free_port_run(),
        scheduler_port=free_port_run(),
        vllm_base_port=free_port_run(2),
        kv_base_port=free_port_run(2),
        max_model_len=max(1024, args.input_len + args.output_len + 16),
        log_dir=log_dir,
        vllm_options={"connector_extra": connector_extra} if connector_extra else {},
    )


@contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """`env` set for the processes started inside, the previous values restored after."""
    with mock.patch.dict(os.environ, env):
        yield


def ab(args: argparse.Namespace, variants: list[Variant], work: Path) -> None:
    """Each variant's stack in turn (gateway, 1P1D), `vllm bench serve` at every concurrency
    on it (the same prompts: same seed), then one table per metric: variant x concurrency,
    and the ratio to the first variant."""
    concurrencies = [int(c) for c in args.max_concurrency.split(",")]
    results: dict[str, dict[int, dict[str, Any]]] = {}
    for i, v in enumerate(variants):
        print(f"== {v.label}", flush=True)
        with _environ(v.env):
            fleet = Fleet(
                _spec(args, work / f"logs-{i}", v.connector_extra),
                say=lambda m: print(f"  {m}", flush=True),
            )
            try:
                fleet.start()
                results[v.label] = {
                    c: bench_serve(fleet.gateway_url, args, c, work / f"v{i}")
                    for c in concurrencies
                }
            finally:
                fleet.stop()
    base = results[variants[0].label]
    print(
        f"\n{args.num_prompts} prompts, random {args.input_len} in / {args.output_len} out "
        "tokens, pdplane 1P1D; value (ratio to the first variant)"
    )
    for key, label in _METRICS:
        print(f"\n{label:<44}" + "".join(f"{'c=' + str(c):>18}" for c in concurrencies))
        for v in variants:
            cells = []
            for c in concurrencies:
                a, b = float(results[v.label][c][key]), float(base[c][key])
                cells.append(f"{a:9.2f} ({a / b:.2f})" if b else f"{a:9.2f}      ")
            print(f"{v.label:<44}" + "".join(f"{cell:>18}" for cell in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-concurrency", default="1,4", help="comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="an already running gateway: measure it alone")
    parser.add_argument(
        "--ab",
        choices=sorted(VARIANTS),
        help="the stack once per variant of bench/vllm_cpu/ttft_breakdown.py (dispatch-mode: "
        "sequential/concurrent dispatch x pull/push KV; first-token: from prefill or decode), "
        "the same prompts each, no reference instance; a table per metric",
    )
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.max_concurrency.split(",")]
    work = Path(tempfile.mkdtemp(prefix="vllm-bench-"))

    if args.url:
        for c in concurrencies:
            bench_serve(args.url, args, c, work / "pdplane")
        return
    if args.ab:
        ab(args, VARIANTS[args.ab], work)
        return
    spec = _spec(args, work / "logs", {})
    fleet = Fleet(spec, say=lambda m: print(f"  {m}", flush=True))
    reference: VllmCpuInstance | None = None
    try:
        fleet.start()
        assert fleet.model_dir is not None
        reference = VllmCpuInstance(
            VllmCpuOptions(
                model=fleet.model_dir,
                port=free_port_run(),
                served_model_name=fleet.model_name,
                max_model_len=spec.max_model_len,
                omp_threads_bind="1",
            ),
            work / "logs" / "reference.log",
        )
        reference.start()
        reference.wait_healthy(300)
        rows = []
        for c in concurrencies:
            ours = bench_serve(fleet.gateway_url, args, c, work / "pdplane")
            theirs = bench_serve(reference.url, args, c, work / "single")
            rows.append((c, ours, theirs))
        print(
            f"\n{args.num_prompts} prompts, random {args.input_len} in / {args.output_len} out "
            "tokens; pdplane (gateway, 1P1D) vs one vLLM instance, same flags"
        )
        print(f"{'concurrency':>11}  {'metric':<16} {'pdplane':>10} {'single':>10} {'ratio':>7}")
        for c, ours, theirs in rows:
            for key, label in _METRICS:
                a, b = float(ours[key]), float(theirs[key])
                ratio = f"{a / b:7.2f}" if b else "    n/a"
                print(f"{c:>11}  {label:<16} {a:10.2f} {b:10.2f} {ratio}")
    finally:
        if reference is not None:
            reference.stop()
        fleet.stop()


if __name__ == "__main__":
    main()
