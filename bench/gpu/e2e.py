"""End to end on GPUs: registry, scheduler, gateway and 1P1D pairs of real vLLM instances with
the pdplane connector on the `nccl` transport, checked against a single vLLM instance.

One stack (registry + scheduler + gateway + prefill + decode) per KV mode (`--modes pull,push`),
all started together next to one plain vLLM instance (no connector). Checks, per mode (exit
status 1 if one fails):
* through the gateway, greedy completions equal the single instance's for the same prompts
  (prompts of about 30 to 760 tokens), each sent plain and streamed (a streamed one takes its
  first token from prefill, and decode continues from prefill's prompt ids + that token);
* decode loaded each prompt's KV from prefill: its external-KV prompt-token counter
  (`vllm:external_prefix_cache_hits` or its successor) grows by the prompt length, give or take
  one block (vLLM recomputes the last prompt token);
* both instances registered on the requested transport (`pdplane ls --json`);
* decode's log shows how each worker got each prompt's KV: `took pushed` in push mode,
  `pulled N blocks` in pull mode (one line per request and TP rank).

`--placement same` (default) puts every instance on GPU 0, each with its own `NCCL_HOSTID` (two
processes on one GPU talk over NCCL's socket transport); `--placement split` puts prefill on GPU 0
and decode on GPU 1 with the real host id (NVLink / PCIe P2P). `--cpu --transport tcp` runs the
same script on vLLM CPU (a dry run of everything but NCCL). Every GPU instance gets
`--enforce-eager`, bf16, block 16, `--gpu-memory-utilization` and `--kv-cache-memory`; `--tp N`
makes every instance tensor-parallel over GPUs 0..N-1 (decode's rank i pulls from prefill's
rank i).
Needs vLLM (>= 0.26) importable; `bench/gpu/e2e.sh` prepares the environment on the GPU machine.

    python bench/gpu/e2e.py --work /tmp/pdplane-e2e --out result.json --kv-cache-memory 4294967296
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdplane.launch.ports import free_port_run
from pdplane.launch.process import ManagedProcess, grpc_serving, http_ok, wait_until
from pdplane.launch.vllm_cpu import LEAN_ENV, VllmCpuOptions, connector_config
from pdplane.models.tiny import build_tiny_model

GPU_BLOCK_SIZE = 16  #: tokens per KV block on GPU (vLLM CPU keeps its default, 128)
CPU_BLOCK_SIZE = 128
_SENTENCES = [
    "The prefill instance computes the prompt's KV cache and the decode instance",
    "Disaggregated serving splits the two phases of inference so that",
    "A lease expires when an instance stops sending heartbeats, and then the registry",
    "NCCL moves the KV cache blocks straight from one GPU's memory into the other's while",
]
#: prompts of about 30, 110, 230 and 760 tokens (the tiny model's tokenizer)
PROMPTS = [" ".join([s] * n) for s, n in zip(_SENTENCES, (1, 3, 8, 18), strict=True)]
#: decode's counter of prompt tokens whose KV came from outside (name differs by vLLM release)
EXTERNAL_METRICS = [
    ("vllm:external_prefix_cache_hits_total", {}),
    ("vllm:external_prefix_cache_hits", {}),
    ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
]


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


def _complete(base: str, model: str, prompt: str, max_tokens: int) -> tuple[dict[str, Any], float]:
    """One greedy completion; returns the response body and its latency (ms)."""
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    ).encode()
    req = urllib.request.Request(
        f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    try:
        answer = json.loads(urllib.request.urlopen(req, timeout=120).read())
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{base}: HTTP {exc.code}: {exc.read()[:500]!r}") from exc
    return answer, (time.perf_counter() - start) * 1e3


def _stream(base: str, model: str, prompt: str, max_tokens: int) -> tuple[str, float]:
    """One greedy streamed completion (through the gateway: the first token from prefill);
    returns its joined text and its TTFT (ms, to the first event with a choice)."""
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
        }
    ).encode()
    req = urllib.request.Request(
        f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    ttft = math.nan
    text: list[str] = []
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"{base}: error event {line[:500]}")
                for choice in event["choices"]:
                    if math.isnan(ttft):
                        ttft = (time.perf_counter() - start) * 1e3
                    text.append(choice["text"])
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{base}: HTTP {exc.code}: {exc.read()[:500]!r}") from exc
    return "".join(text), ttft


@dataclass
class Stack:
    """The pdplane services and the vLLM pair of one KV mode."""

    mode: str
    registry: str
    gateway_url: str
    prefill: VllmCpuOptions
    decode: VllmCpuOptions
    procs: list[ManagedProcess] = field(default_factory=list)
    vllms: list[ManagedProcess] = field(default_factory=list)


class Run:
    """Starts processes for one run and stops them all at the end (newest first)."""

    def __init__(self, args: argparse.Namespace, model: Path) -> None:
        self.args = args
        self.model = model
        self.work: Path = args.work
        self.procs: list[ManagedProcess] = []

    def service(self, name: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess(name, argv, self.work / f"{name}.log")
        proc.start()
        self.procs.append(proc)
        return proc

    def vllm(self, name: str, opts: VllmCpuOptions, gpu: int) -> ManagedProcess:
        args = self.args
        device_args = (
            ["--dtype", "float32", "--num-gpu-blocks-override", "64",
             "--distributed-executor-backend", "uni"]
            if args.cpu
            else ["--dtype", "bfloat16", "--block-size", str(GPU_BLOCK_SIZE)]
        )  # fmt: skip
        if not args.cpu:
            # vLLM checks free memory against --gpu-memory-utilization at startup even when
            # --kv-cache-memory fixes the KV size; the fixed size skips the memory profiling,
            # which fails when instances sharing a GPU start together (each sees the others).
            device_args += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
            if args.kv_cache_memory:
                device_args += ["--kv-cache-memory", str(args.kv_cache_memory)]
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(opts.model), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(opts.port),
            "--enforce-eager", "--max-model-len", "1024", *device_args,
        ]  # fmt: skip
        if args.tp > 1:
            argv += ["--tensor-parallel-size", str(args.tp)]
        config = connector_config(opts)
        if config is not None:
            argv += ["--kv-transfer-config", json.dumps(config)]
        env = dict(os.environ)
        if args.cpu:  # the lean CPU settings of the project's CPU launcher
            env.update(LEAN_ENV)
        else:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu + r) for r in range(args.tp))
        if args.placement == "same":
            # Processes sharing a GPU must look like separate hosts to NCCL.
            env["NCCL_HOSTID"] = f"pdplane-{name}"
        env.update(
            NCCL_NVLS_ENABLE="0",
            VLLM_USE_FLASHINFER_SAMPLER="0",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
        )
        proc = ManagedProcess(name, argv, self.work / f"{name}.log", env=env)
        proc.start()
        self.procs.append(proc)
        return proc

    def stack(self, mode: str) -> Stack:
        """Starts registry, scheduler, gateway and a prefill/decode pair in `mode`."""
        args = self.args
        ports = [free_port_run() for _ in range(7)]
        ports[4], ports[6] = free_port_run(args.tp), free_port_run(args.tp)
        registry, scheduler = f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"
        host = ["--host", "127.0.0.1"]
        reg = self.service(f"{mode}-registry", _pdplane("registry", *host, "--port", str(ports[0])))
        wait_until(lambda: grpc_serving(registry), 60, watch=[reg], what="registry")
        sch = self.service(
            f"{mode}-scheduler",
            _pdplane("scheduler", "--registry", registry, *host, "--port", str(ports[1])),
        )
        wait_until(lambda: grpc_serving(scheduler), 60, watch=[sch], what="scheduler")
        gw = self.service(
            f"{mode}-gateway",
            _pdplane(
                "gateway", "--scheduler", scheduler, "--registry", registry,
                *host, "--port", str(ports[2]),
            ),
        )  # fmt: skip
        extra = {"transport": args.transport, "mode": mode}
        common: dict[str, Any] = {"registry": registry, "connector_extra": extra}
        prefill = VllmCpuOptions(
            model=self.model, port=ports[3], role="kv_producer", kv_port=ports[4], **common
        )
        decode = VllmCpuOptions(
            model=self.model, port=ports[5], role="kv_consumer", kv_port=ports[6], **common
        )
        stack = Stack(
            mode, registry, f"http://127.0.0.1:{ports[2]}", prefill, decode, [reg, sch, gw]
        )
        decode_gpu = 1 if args.placement == "split" else 0
        stack.vllms.append(self.vllm(f"{mode}-prefill", prefill, 0))
        stack.vllms.append(self.vllm(f"{mode}-decode", decode, decode_gpu))
        return stack

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def _registered(stack: Stack) -> list[dict[str, Any]]:
    out = subprocess.run(
        _pdplane("ls", "--registry", stack.registry, "--json"),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return json.loads(out)  # type: ignore[no-any-return]


def _check_mode(stack: Stack, single: VllmCpuOptions, args: argparse.Namespace) -> dict[str, Any]:
    """Sends every prompt through the gateway and to the single instance; compares."""
    wait_until(
        lambda: http_ok(f"{stack.gateway_url}/health"),
        120,
        watch=[*stack.procs, *stack.vllms],
        what=f"{stack.mode} gateway /health (a usable pair)",
    )
    instances = _registered(stack)
    transports = sorted({str(i.get("transport", "?")) for i in instances})
    block = CPU_BLOCK_SIZE if args.cpu else GPU_BLOCK_SIZE
    decode_log = stack.vllms[1].log_path
    log_start = decode_log.stat().st_size if decode_log.exists() else 0
    rows = []
    for prompt in PROMPTS:
        name, before = _metric(stack.decode.url)
        got, gateway_ms = _complete(stack.gateway_url, "tiny", prompt, args.max_tokens)
        _, after = _metric(stack.decode.url)
        want, single_ms = _complete(single.url, "tiny", prompt, args.max_tokens)
        # Streamed, another prompt of the same length (decode has this one's blocks cached
        # now): decode loads prefill's tokens and computes the first token appended to them.
        other = "Streamed. " + prompt
        streamed, stream_ttft_ms = _stream(stack.gateway_url, "tiny", other, args.max_tokens)
        _, streamed_after = _metric(stack.decode.url)
        want_streamed, _ = _complete(single.url, "tiny", other, args.max_tokens)
        prompt_tokens = int(want["usage"]["prompt_tokens"])
        stream_prompt_tokens = int(want_streamed["usage"]["prompt_tokens"])
        external = after - before
        stream_external = streamed_after - after
        rows.append(
            {
                "prompt_tokens": prompt_tokens,
                "external_tokens": external,
                "stream_external_tokens": stream_external,
                "metric": name,
                "text_equal": got["choices"][0]["text"] == want["choices"][0]["text"],
                "stream_text_equal": streamed == want_streamed["choices"][0]["text"],
                "stream_ttft_ms": round(stream_ttft_ms, 1),
                "kv_loaded": all(
                    e > 0 and n - block <= e <= n
                    for e, n in ((external, prompt_tokens), (stream_external, stream_prompt_tokens))
                ),
                "gateway_ms": round(gateway_ms, 1),
                "single_ms": round(single_ms, 1),
                "gateway_text": got["choices"][0]["text"],
                "single_text": want["choices"][0]["text"],
            }
        )
    # How each decode worker got the KV (one line per request and TP rank, pdplane.connector.pulls)
    with decode_log.open("rb") as log:
        log.seek(log_start)
        text = log.read().decode(errors="replace")
    loads = {
        "took_pushed": text.count("took pushed"),
        "pulled": len(re.findall(r"pulled \d+ blocks", text)),
    }
    expected = "took_pushed" if stack.mode == "push" else "pulled"
    ok = (
        transports == [args.transport]
        and all(r["text_equal"] and r["stream_text_equal"] and r["kv_loaded"] for r in rows)
        and loads[expected] == 2 * len(PROMPTS) * args.tp  # each prompt plain and streamed
    )
    return {
        "ok": ok,
        "transports": transports,
        "instances": len(instances),
        "decode_loads": loads,
        "requests": rows,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/pdplane-e2e"))
    p.add_argument("--out", type=Path)
    p.add_argument("--modes", default="pull,push", help="KV modes to run, comma separated")
    p.add_argument("--placement", default="same", choices=["same", "split"])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--transport", default="nccl", choices=["nccl", "tcp"])
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size of every instance (GPUs 0..tp-1; rank i pulls from rank i)",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=int,
        default=0,
        help="KV cache bytes per GPU instance (required on GPUs: instances sharing a GPU "
        "start together)",
    )
    p.add_argument(
        "--cpu", action="store_true", help="vLLM CPU instead (with --transport tcp: a dry run)"
    )
    args = p.parse_args()
    if not args.cpu and not args.kv_cache_memory:
        p.error("instances sharing a GPU start together: pass --kv-cache-memory BYTES")
    if args.tp > 1 and args.placement != "same":
        p.error("--tp > 1 puts every instance on GPUs 0..tp-1: use --placement same")
    args.work.mkdir(parents=True, exist_ok=True)
    modes = [m for m in args.modes.split(",") if m]
    model = build_tiny_model(args.work / "models")
    run = Run(args, model)
    result: dict[str, Any] = {
        "ok": False,
        "placement": args.placement,
        "tp": args.tp,
        "transport": args.transport,
        "modes": {},
    }
    started = time.monotonic()
    try:
        single = VllmCpuOptions(model=model, port=free_port_run())
        single_proc = run.vllm("single", single, 0)
        stacks = [run.stack(mode) for mode in modes]
        for opts, proc in [(single, single_proc)] + [
            (o, v) for s in stacks for o, v in zip((s.prefill, s.decode), s.vllms, strict=True)
        ]:
            wait_until(
                functools.partial(http_ok, f"{opts.url}/health"),
                600,
                watch=[proc],
                what=f"vLLM {proc.name}",
            )
        result["startup_s"] = round(time.monotonic() - started, 1)
        for stack in stacks:
            try:
                result["modes"][stack.mode] = _check_mode(stack, single, args)
            except Exception as exc:  # the other modes still run
                result["modes"][stack.mode] = {
                    "ok": False,
                    "error": f"{type(exc).__name__}: {exc}",
                    "logs": {proc.name: proc.tail(40) for proc in [*stack.procs, *stack.vllms]},
                }
        result["ok"] = bool(stacks) and all(m["ok"] for m in result["modes"].values())
    except Exception as exc:  # report, then stop everything
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["logs"] = {proc.name: proc.tail(40) for proc in run.procs}
    finally:
        run.stop()
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
