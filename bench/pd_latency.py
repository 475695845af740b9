"""TTFT and end-to-end latency of one prompt, disaggregated (gateway -> 1P1D) vs one plain vLLM
instance with the same flags, side by side in one run, on real vLLM CPU instances.

    .venv/bin/python bench/pd_latency.py [--runs 20] [--prompt-tokens 512] [--max-tokens 32]

Starts `pdplane up`'s stack (registry, scheduler, gateway, prefill, decode) plus a reference
instance, then sends the same sequence of fresh prompts (token ids, so the count is exact; fresh
so that no prefix cache answers) to both, one request at a time, streamed. Prints p50/p90/mean of
TTFT (ms, first streamed token) and total latency (ms), and the ratio disaggregated / single.
Also prints how long the stack took to become ready (s).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from pdplane.launch.fleet import Fleet, FleetSpec
from pdplane.launch.ports import free_port_run
from pdplane.launch.vllm_cpu import VllmCpuInstance, VllmCpuOptions

VOCAB = 2048


def _timed_stream(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(TTFT ms, total ms) of one streamed completion."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    ttft = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300.0) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            first = ttft is None and line.startswith("data: {")
            if first and json.loads(line[6:])["choices"][0].get("text"):
                ttft = (time.perf_counter() - start) * 1000
    total = (time.perf_counter() - start) * 1000
    return (ttft if ttft is not None else total), total


def _summary(name: str, values: list[float]) -> str:
    q = statistics.quantiles(values, n=10)
    return (
        f"{name:<26} p50 {statistics.median(values):8.1f}  p90 {q[8]:8.1f}  "
        f"mean {statistics.fmean(values):8.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    logs = Path(tempfile.mkdtemp(prefix="pd-latency-"))
    spec = FleetSpec(
        gateway_port=free_port_run(),
        registry_port=free_port_run(),
        scheduler_port=free_port_run(),
        vllm_base_port=free_port_run(2),  # prefill, decode: base and base + 1
        kv_base_port=free_port_run(2),
        log_dir=logs,
    )
    fleet = Fleet(spec, say=lambda m: print(f"  {m}", flush=True))
    reference: VllmCpuInstance | None = None
    try:
        fleet.start()
        print(f"stack ready in {fleet.ready_after_s:.1f} s (logs {logs})")
        assert fleet.model_dir is not None
        reference = VllmCpuInstance(
            VllmCpuOptions(
                model=fleet.model_dir,
                port=free_port_run(),
                served_model_name=fleet.model_name,
                omp_threads_bind="1",
            ),
            logs / "reference.log",
        )
        reference.start()
        reference.wait_healthy(300)
        rng = random.Random(args.seed)
        results: dict[str, tuple[list[float], list[float]]] = {
            "disaggregated (gateway)": ([], []),
            "single instance": ([], []),
        }
        targets = {"disaggregated (gateway)": fleet.gateway_url, "single instance": reference.url}
        # Warm both paths once (first requests pay lazy initialisation).
        for url in targets.values():
            _timed_stream(url, fleet.model_name, [rng.randrange(8, VOCAB) for _ in range(16)], 4)
        for _ in range(args.runs):
            prompt = [rng.randrange(8, VOCAB) for _ in range(args.prompt_tokens)]
            for name, url in targets.items():
                ttft, total = _timed_stream(url, fleet.model_name, prompt, args.max_tokens)
                results[name][0].append(ttft)
                results[name][1].append(total)
        print(
            f"\n{args.runs} runs, {args.prompt_tokens}-token prompt, {args.max_tokens} output "
            "tokens, one request at a time (ms)"
        )
        for name, (ttfts, totals) in results.items():
            print(_summary(f"TTFT  {name}", ttfts))
            print(_summary(f"total {name}", totals))
        dis, single = results["disaggregated (gateway)"], results["single instance"]
        print(
            f"ratio disaggregated/single: TTFT p50 "
            f"{statistics.median(dis[0]) / statistics.median(single[0]):.2f}, total p50 "
            f"{statistics.median(dis[1]) / statistics.median(single[1]):.2f}"
        )
    finally:
        if reference is not None:
            reference.stop()
        fleet.stop()


if __name__ == "__main__":
    main()
