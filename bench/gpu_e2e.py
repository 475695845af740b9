"""End to end on one GPU: registry, scheduler, gateway and a 1P1D pair of real vLLM instances
with the pdplane connector on the `nccl` transport, checked against a single vLLM instance.

Checks (exit status 1 if one fails):
* through the gateway, greedy completions equal a single instance's for the same prompts;
* decode loaded the prompt's KV from prefill: its external-KV prompt-token counter grows by the
  prompt length (all but at most one block per request, which vLLM may recompute).

`--cpu --transport tcp` runs the same script on vLLM CPU (a dry run of everything but NCCL).
Every vLLM GPU instance gets `--gpu-memory-utilization` (default 0.2), `--enforce-eager` and its own
`NCCL_HOSTID` (two processes on one GPU talk over NCCL's socket transport). Needs vLLM (>= 0.26)
importable; `bench/gpu_e2e.sh` prepares the environment on the GPU machine.

    python bench/gpu_e2e.py --work /tmp/pdplane-e2e --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import urllib.request
from pathlib import Path
from typing import Any

from pdplane.launch.process import ManagedProcess, grpc_serving, http_ok, wait_until
from pdplane.launch.vllm_cpu import LEAN_ENV, VllmCpuOptions, connector_config
from pdplane.models.tiny import build_tiny_model

GPU_BLOCK_SIZE = 16  #: tokens per KV block on GPU (vLLM CPU keeps its default, 128)
CPU_BLOCK_SIZE = 128
PROMPTS = [
    "The prefill instance computes the prompt's KV cache and the decode instance",
    "Disaggregated serving splits the two phases of inference so that",
    "A lease expires when an instance stops sending heartbeats, and then the registry",
    "NCCL moves the KV cache blocks straight from one GPU's memory into the other's while",
]
#: decode's counter of prompt tokens whose KV came from outside (name differs by vLLM release)
EXTERNAL_METRICS = [
    ("vllm:external_prefix_cache_hits_total", {}),
    ("vllm:external_prefix_cache_hits", {}),
    ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _pdplane(*args: str) -> list[str]:
    code = "import sys; from pdplane.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return [sys.executable, "-c", code, *args]


def _metric(url: str) -> tuple[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    for name, labels in EXTERNAL_METRICS:
        total, found = 0.0, False
        for line in text.splitlines():
            m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", line)
            if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
                total += float(m.group(2))
                found = True
        if found:
            return name, total
    raise RuntimeError(f"{url}/metrics has none of {[n for n, _ in EXTERNAL_METRICS]}")


def _complete(base: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    ).encode()
    req = urllib.request.Request(
        f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    return json.loads(urllib.request.urlopen(req, timeout=120).read())  # type: ignore[no-any-return]


def _vllm(name: str, opts: VllmCpuOptions, args: argparse.Namespace, work: Path) -> ManagedProcess:
    device_args = (
        ["--dtype", "float32", "--num-gpu-blocks-override", "64",
         "--distributed-executor-backend", "uni"]
        if args.cpu
        else [
            "--dtype", "bfloat16", "--block-size", str(GPU_BLOCK_SIZE),
            "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        ]
    )  # fmt: skip
    if args.kv_cache_memory and not args.cpu:
        # A fixed KV size skips vLLM's memory profiling, which fails when instances sharing a
        # GPU start at the same time (each sees the others' allocations).
        device_args += ["--kv-cache-memory", str(args.kv_cache_memory)]
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(opts.model),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(opts.port),
        "--enforce-eager",
        "--max-model-len",
        "1024",
        *device_args,
    ]
    config = connector_config(opts)
    if config is not None:
        argv += ["--kv-transfer-config", json.dumps(config)]
    env = dict(os.environ)
    if args.cpu:  # the lean CPU settings of the project's CPU launcher
        env.update(LEAN_ENV)
    env.update(
        NCCL_HOSTID=f"pdplane-{name}",
        NCCL_NVLS_ENABLE="0",
        VLLM_USE_FLASHINFER_SAMPLER="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
    )
    proc = ManagedProcess(name, argv, work / f"{name}.log", env=env)
    proc.start()
    return proc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/pdplane-e2e"))
    p.add_argument("--out", type=Path)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--transport", default="nccl", choices=["nccl", "tcp"])
    p.add_argument(
        "--kv-cache-memory",
        type=int,
        default=0,
        help="KV cache bytes per GPU instance: instances start together; 0 = one after another",
    )
    p.add_argument(
        "--cpu", action="store_true", help="vLLM CPU instead (with --transport tcp: a dry run)"
    )
    args = p.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(work / "models")
    ports = [_free_port() for _ in range(8)]
    registry, scheduler, gateway = f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}", ports[2]
    procs: list[ManagedProcess] = []
    result: dict[str, Any] = {"ok": False}
    try:

        def service(name: str, argv: list[str]) -> ManagedProcess:
            proc = ManagedProcess(name, argv, work / f"{name}.log")
            proc.start()
            procs.append(proc)
            return proc

        reg = service(
            "registry", _pdplane("registry", "--host", "127.0.0.1", "--port", str(ports[0]))
        )
        wait_until(lambda: grpc_serving(registry), 60, watch=[reg], what="registry")
        sch = service(
            "scheduler",
            _pdplane(
                "scheduler", "--registry", registry, "--host", "127.0.0.1", "--port", str(ports[1])
            ),
        )
        wait_until(lambda: grpc_serving(scheduler), 60, watch=[sch], what="scheduler")
        gw = service(
            "gateway",
            _pdplane(
                "gateway",
                "--scheduler",
                scheduler,
                "--registry",
                registry,
                "--host",
                "127.0.0.1",
                "--port",
                str(gateway),
            ),
        )
        common = {"registry": registry, "connector_extra": {"transport": args.transport}}
        prefill = VllmCpuOptions(
            model=model, port=ports[3], role="kv_producer", kv_port=ports[4], **common
        )  # type: ignore[arg-type]
        decode = VllmCpuOptions(
            model=model, port=ports[5], role="kv_consumer", kv_port=ports[6], **common
        )  # type: ignore[arg-type]
        single = VllmCpuOptions(model=model, port=ports[7])
        together = bool(args.kv_cache_memory) or args.cpu
        vllms: list[ManagedProcess] = []
        for name, opts in (("prefill", prefill), ("decode", decode), ("single", single)):
            vllms.append(_vllm(name, opts, args, work))
            procs.append(vllms[-1])
            if not together:  # memory profiling needs the GPU to itself
                wait_until(lambda o=opts: http_ok(f"{o.url}/health"), 600, watch=vllms,
                           what=f"vLLM {opts.url}")  # fmt: skip
        for opts in (prefill, decode, single):
            wait_until(
                lambda o=opts: http_ok(f"{o.url}/health"), 600, watch=vllms, what=f"vLLM {opts.url}"
            )
        gw_url = f"http://127.0.0.1:{gateway}"
        wait_until(
            lambda: http_ok(f"{gw_url}/health"),
            120,
            watch=[gw, *vllms],
            what="gateway /health (a usable pair)",
        )
        rows = []
        for prompt in PROMPTS:
            name, before = _metric(decode.url)
            got = _complete(gw_url, "tiny", prompt, args.max_tokens)
            _, after = _metric(decode.url)
            want = _complete(single.url, "tiny", prompt, args.max_tokens)
            prompt_tokens = int(want["usage"]["prompt_tokens"])
            rows.append(
                {
                    "prompt_tokens": prompt_tokens,
                    "external_tokens": after - before,
                    "metric": name,
                    "text_equal": got["choices"][0]["text"] == want["choices"][0]["text"],
                    "gateway_text": got["choices"][0]["text"],
                    "single_text": want["choices"][0]["text"],
                }
            )
        result["requests"] = rows
        block = CPU_BLOCK_SIZE if args.cpu else GPU_BLOCK_SIZE
        result["ok"] = all(
            r["text_equal"]
            and r["prompt_tokens"] - block <= r["external_tokens"] <= r["prompt_tokens"]
            for r in rows
        )
    except Exception as exc:  # report, then stop everything
        result["error"] = f"{type(exc).__name__}: {exc}"
        for proc in procs:
            result.setdefault("logs", {})[proc.name] = proc.tail(40)
    finally:
        for proc in reversed(procs):
            proc.stop()
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
