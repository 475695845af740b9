"""The two servers a calibration compares: real vLLM (three targets) and `pdplane sim`.

Targets:
- `cpu`: vLLM CPU serving `pdplane.models.tiny` (real weights) with the lean flags and the
  `tiny-cpu` profile's limits, pinned to the engine cores.
- `gpu`: vLLM on a GPU serving a Llama-3-8B-shaped `config.json` with `--load-format dummy`
  (random weights: real compute, real KV sizes, no download) and the tiny tokenizer padded to
  the model's vocabulary (the random model samples any of its 128256 ids; the padding makes
  every id decodable).
- `cpu-dummy`: the `gpu` target's path (dummy weights, padded tokenizer, vLLM's own limits read
  back) on vLLM CPU with a small architecture: a dry run of `--target gpu` on any machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from pdplane.launch.ports import free_port_run

__all__ = ["LLAMA3_8B_CONFIG", "SMALL_SHAPE", "cache_config", "start_sim", "start_vllm", "stop"]

MODEL = "calib"

#: Llama-3-8B's architecture (config.json of meta-llama/Meta-Llama-3-8B), weights left random.
LLAMA3_8B_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
#: A small architecture for dry runs on CPU (same code path, seconds instead of minutes).
SMALL_SHAPE: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
    "torch_dtype": "float32",
}
_SMALL_CONFIG = {**LLAMA3_8B_CONFIG, **SMALL_SHAPE}


def _taskset(cores: str) -> list[str]:
    return ["taskset", "-c", cores] if cores and os.path.exists("/usr/bin/taskset") else []


def _wait_http(url: str, proc: subprocess.Popen[Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout_s} s")


def cache_config(base_url: str) -> dict[str, str]:
    """vLLM's `vllm:cache_config_info` labels (num_gpu_blocks, block_size, ...)."""
    text = urllib.request.urlopen(base_url + "/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = line[line.index("{") + 1 : line.rindex("}")]
            out = {}
            for part in labels.split('",'):
                k, _, v = part.partition("=")
                out[k.strip()] = v.strip('"')
            return out
    return {}


def dummy_model(tiny: Path, dest: Path, config: dict[str, Any]) -> Path:
    """A model directory: `config` + the tiny tokenizer padded to config's vocabulary."""
    from tokenizers import AddedToken, Tokenizer

    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    have = tok.get_vocab_size()
    pad = [AddedToken(f"<x{i}>", normalized=False) for i in range(have, config["vocab_size"])]
    tok.add_tokens(pad)
    tok.save(str(dest / "tokenizer.json"))
    for f in tiny.iterdir():
        if f.name in ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            (dest / f.name).write_bytes(f.read_bytes())
    return dest


def start_vllm(
    target: str, work: Path, *, cores: str = "", gpu_util: float = 0.9, eager: bool = False
) -> tuple[subprocess.Popen[Any], str]:
    """Starts the real vLLM server for `target`; returns (process, base URL)."""
    from pdplane.models.tiny import build_tiny_model
    from pdplane.sim.profiles import PROFILES

    tiny = build_tiny_model(work / "models")
    port = free_port_run()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    common = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL]
    cpu_env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": cores or "all",
    }
    if target == "gpu":
        model = dummy_model(tiny, work / "llama3-8b-dummy", LLAMA3_8B_CONFIG)
        argv = [*server, *common, "--model", str(model), "--load-format", "dummy"]
        argv += ["--dtype", "bfloat16", "--max-model-len", "8192"]
        argv += ["--gpu-memory-utilization", str(gpu_util)]
        argv += ["--enforce-eager"] if eager else []
        env.update(VLLM_USE_FLASHINFER_SAMPLER="0", NCCL_NVLS_ENABLE="0")
        timeout = 900.0
    elif target == "cpu-dummy":
        model = dummy_model(tiny, work / "small-dummy", _SMALL_CONFIG)
        argv = [*_taskset(cores), *server, *common, "--model", str(model)]
        argv += ["--load-format", "dummy", "--dtype", "float32", "--max-model-len", "1024"]
        argv += ["--enforce-eager", "--distributed-executor-backend", "uni"]
        env.update(cpu_env)
        timeout = 300.0
    else:
        p = PROFILES["tiny-cpu"]
        argv = [*_taskset(cores), *server, *common, "--model", str(tiny), "--dtype", "float32"]
        argv += ["--max-model-len", str(p.max_model_len), "--enforce-eager"]
        argv += ["--distributed-executor-backend", "uni"]
        argv += ["--num-gpu-blocks-override", str(p.num_blocks)]
        argv += ["--max-num-seqs", str(p.max_num_seqs)]
        argv += ["--max-num-batched-tokens", str(p.max_num_batched_tokens)]
        env.update(cpu_env)
        timeout = 300.0
    log = (work / "vllm.log").open("w")
    proc = subprocess.Popen(argv, stdout=log, stderr=log, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/health", proc, timeout)
    return proc, url


def start_sim(profile: str, cores: str, work: Path) -> tuple[subprocess.Popen[Any], str]:
    """`pdplane sim` (one instance, `profile`) on `cores`; returns (process, base URL)."""
    port = free_port_run()
    argv = [*_taskset(cores), sys.executable, "-m", "pdplane.cli.main", "sim", "--role", "both"]
    argv += ["--port", str(port), "--model", MODEL, "--profile", profile]
    argv += ["--record-limit", "0", "--no-kv-events"]
    log = (work / "sim.log").open("a")
    proc = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/health", proc, 60)
    return proc, url


def stop(proc: subprocess.Popen[Any]) -> None:
    """Ends a server's whole process group (SIGTERM, then SIGKILL after 30 s)."""
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
