"""`vllm bench serve` against pdplane (gateway -> 1P1D) and against one plain vLLM instance with
the same flags, side by side in one run, on real vLLM CPU instances.

    .venv/bin/python bench/vllm_bench.py [--num-prompts 32] [--input-len 256] [--output-len 32]
        [--max-concurrency 1,4] [--url http://127.0.0.1:8000]

Starts `pdplane up`'s stack on free ports plus a reference instance (or, with `--url`, measures
an already running gateway alone), then runs the environment's `vllm bench serve` (random
dataset, fixed seed: the same prompts for both targets; no `--model`, so vLLM's client takes the
model and its tokenizer from /v1/models as against `vllm serve`) for every concurrency, first on
the gateway, then on the single instance. Prints each run's own result table, then one line per
metric with the ratio pdplane / single instance.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pdplane.launch.fleet import Fleet, FleetSpec
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-concurrency", default="1,4", help="comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="an already running gateway: measure it alone")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.max_concurrency.split(",")]
    work = Path(tempfile.mkdtemp(prefix="vllm-bench-"))

    if args.url:
        for c in concurrencies:
            bench_serve(args.url, args, c, work / "pdplane")
        return
    spec = FleetSpec(
        gateway_port=free_port_run(),
        registry_port=free_port_run(),
        scheduler_port=free_port_run(),
        vllm_base_port=free_port_run(2),
        kv_base_port=free_port_run(2),
        max_model_len=max(1024, args.input_len + args.output_len + 16),
        log_dir=work / "logs",
    )
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
