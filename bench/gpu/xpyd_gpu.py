"""The XpYd serving benchmark on real vLLM: `vllm bench serve` against one plain vLLM instance and
against pdplane 1P1D, on the same GPU(s), the same model and the same KV budget per instance.

Rows (`--rows`, comma separated; all rows' instances start together and stay up, and the rows
are measured one after the other, so each row has the GPU's compute to itself while it runs):
- `plain`: one vLLM instance, no connector (the one-GPU baseline);
- `pdplane`: registry, scheduler and gateway as `pdplane up` starts them (a generated fleet
  token, KV-aware policies, the gateway with no `--tokenizer`: it takes the tokenizer the
  instances publish) and a 1P1D pair of `vllm serve` with the pdplane connector: pull, the
  first token from prefill (the defaults);
- `pdplane-ft-decode`: a second gateway over the same pair with `--first-token decode`;
- `pdplane-embedded`: a second gateway over the same pair with `--scheduler embedded` (the
  decision in the gateway's process: no Schedule round trip to the scheduler);
- `pdplane-push`: its own registry, scheduler, gateway and pair with the connector's push mode;
- `nixl-router`: vLLM's own P/D, a 1P1D pair of `vllm serve` with `NixlConnector` (`kv_role:
  kv_both`, each its own `VLLM_NIXL_SIDE_CHANNEL_PORT`; `--nixl-env` sets UCX's environment, e.g.
  `UCX_TLS`) behind vllm-router's P/D mode (`vllm-router --vllm-pd-disaggregation`, PyPI
  `vllm-router`);
- `nixl-proxy`: the same pair behind vLLM's toy proxy for NIXL (`--toy-proxy`: vLLM's
  `tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`, which is not in vLLM's wheel).

The model (`--shape`): a Llama-3.1-8B-shaped `config.json` (hidden 4096, 32 layers, 32 heads /
8 KV heads, intermediate 14336, vocabulary 128256, llama3 RoPE scaling) loaded with
`--load-format dummy` (random weights: real compute and KV sizes, no download) next to the tiny
model's tokenizer padded to the vocabulary; `small` is a 2-layer stand-in for a dry run on vLLM
CPU (`--device cpu`, TCP transport). Every GPU instance: bf16, block 16, `--kv-cache-memory`
bytes of KV (the same budget per instance), `--gpu-memory-utilization`, `--enforce-eager`
unless `--cuda-graphs`, its own `NCCL_HOSTID` when instances share a GPU (NCCL then uses its
socket transport between them).

The load: for each input length (`--input-lens`), concurrency (`--concurrency`) and row, one `vllm
bench serve --backend vllm --dataset-name random --random-input-len L --random-output-len 256
--ignore-eos --max-concurrency C --num-prompts N --num-warmups W --goodput ttft:1000
--percentile-metrics ttft,tpot,itl --metric-percentiles 50,99 --save-detailed`, run in this process
(vLLM's own `vllm.benchmarks.serve`, imported once). N = `--prompts-per-concurrency` x C and W = C,
capped by `--max-prompts` / `--max-warmups`. The seed of a cell is `--seed` + L + C (+ 7 for
pdplane-ft-decode, which shares pdplane's pair): every row on its own instances gets the same
prompts, and no cell's prompts are in the prefix cache an earlier cell left. Cells run in the order
of `--order` (default: every concurrency 1 cell first; `by-row`: one row's cells after another,
so a run cut short has whole rows).

Written to `--out` after every cell, so a run cut short keeps what it measured:
`results.json` (every cell's vLLM result with each request's TTFT, the startup, the gateways'
`/health`, per cell decode's KV transfers and how many requests the gateway sent to decode
alone), `table.md` (the table in the seed's format: Req/s, goodput, output tok/s, TTFT,
TPOT and ITL p50/p99 per row and concurrency, and ratios to `plain`), `tokenizer.txt` (the
gateway's routing state and the instances' log lines about the tokenizer); at the end
`logs.tgz`. `--resume results.json` skips the cells already in that file. `--deadline-s` stops
starting cells that late into the run (the summary files still get written).

KV transfer per 10k tokens (`results.json` `pulls`, table footnote): decode's connector logs
every pull ("transfer T: pulled N blocks, B bytes in X ms"); the script reads them per cell. For
the NIXL rows it keeps decode's "KV Transfer metrics" lines (vLLM's own transfer statistics).
Where the time goes (`results.json` `breakdown`, per cell): the mean of each latency histogram
the row's processes export (the gateway's TTFT and prefill/decode legs, each vLLM instance's
TTFT, queue and prefill time), from their `/metrics` before and after the cell; and
(`first_tokens`) how many streams took their first token from prefill and how many from
decode (the gateway's `pdplane_gateway_first_tokens_total`).

    python bench/gpu/xpyd_gpu.py --out /tmp/xpyd --rows plain,pdplane --input-lens 1000,8000 \
        --concurrency 1,16,64 --kv-cache-memory 16000000000

Needs vLLM (>= 0.26) and pdplane importable (PYTHONPATH with services/ and connector/).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import secrets
import statistics
import sys
import tarfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.sim.calib_servers import LLAMA3_8B_CONFIG, SMALL_SHAPE, dummy_model
from pdplane.launch.deployment import Fleet, FleetSpec
from pdplane.launch.ports import free_port_run
from pdplane.launch.process import ManagedProcess, http_ok, wait_until
from pdplane.launch.vllm_cpu import (
    LEAN_ENV,
    VllmCpuOptions,
    connector_config,
    kv_events_config,
    serve_argv,
)
from pdplane.models.tiny import build_tiny_model

MODEL = "llama-3.1-8b-dummy"
ROWS = (
    "plain",
    "pdplane",
    "pdplane-ft-decode",
    "pdplane-embedded",
    "pdplane-push",
    "nixl-router",
    "nixl-proxy",
)
#: the second gateways over pdplane's pair: row -> the gateway's flags
SECOND_GATEWAYS = {
    "pdplane-ft-decode": ("--first-token", "decode"),
    "pdplane-embedded": ("--scheduler", "embedded"),
}
#: the rows served by vLLM's NixlConnector pair, and the front each puts before it
NIXL_ROWS = ("nixl-router", "nixl-proxy")
GPU_BLOCK_SIZE = 16  #: tokens per KV block on GPU
#: Llama-3.1-8B's architecture (config.json of meta-llama/Llama-3.1-8B), weights left random.
LLAMA31_8B_CONFIG: dict[str, Any] = {
    **LLAMA3_8B_CONFIG,
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}
#: A 2-layer stand-in: the same code path on vLLM CPU in seconds.
SMALL_CONFIG: dict[str, Any] = {**LLAMA31_8B_CONFIG, **SMALL_SHAPE}
#: decode's connector, one line per pull (pdplane.connector.pulls)
_PULL_LINE = re.compile(
    r"transfer \S+: (pulled|took pushed) (\d+) blocks, (\d+) bytes in ([\d.]+) ms"
)
#: log lines about the tokenizer the instances publish and the gateways take
_TOKENIZER_LINE = re.compile(r"tokenizer|routing is|precise", re.IGNORECASE)
#: vLLM's NixlConnector statistics, logged by the engine with its other stats
_NIXL_STATS_LINE = re.compile(r"KV Transfer metrics.*")
#: the latency histograms whose means make a cell's breakdown (seconds in, ms out)
_BREAKDOWN = (
    "pdplane_gateway_ttft_seconds",
    "pdplane_gateway_leg_latency_seconds",
    "vllm:time_to_first_token_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:e2e_request_latency_seconds",
)
#: the gateway's first tokens by source (prefill, decode): a counter, read per cell
_FIRST_TOKENS = "pdplane_gateway_first_tokens_total"
#: (result key, column) of the table, in the seed's order
_COLUMNS = (
    ("request_throughput", "Req/s"),
    ("request_goodput", "Goodput req/s"),
    ("output_throughput", "Out tok/s"),
    ("p50_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("p50_tpot_ms", "TPOT p50 ms"),
    ("p99_tpot_ms", "TPOT p99 ms"),
    ("p50_itl_ms", "ITL p50 ms"),
    ("p99_itl_ms", "ITL p99 ms"),
)


@dataclass
class Target:
    """Where one row's requests go, and (pdplane rows) the decode log its pulls are read from."""

    row: str
    url: str
    decode_log: Path | None = None
    gateway_url: str | None = None
    gateway_log: Path | None = None
    #: role (plain, prefill, decode, gateway) -> base URL whose /metrics the breakdown reads
    metrics: dict[str, str] = field(default_factory=dict)


@dataclass
class Launcher:
    """Starts every process of the run and stops them all (newest first)."""

    args: argparse.Namespace
    model: Path
    procs: list[ManagedProcess] = field(default_factory=list)
    fleets: list[Fleet] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    #: (row, name, process, base URL) of every vLLM instance
    vllms: list[tuple[str, str, ManagedProcess, str]] = field(default_factory=list)

    def vllm(
        self,
        row: str,
        name: str,
        gpu: int,
        opts: VllmCpuOptions | None = None,
        token: str | None = None,
        kv_config: dict[str, Any] | None = None,
        env_extra: dict[str, str] | None = None,
    ) -> tuple[ManagedProcess, str]:
        """One `vllm serve` (with pdplane's connector when `opts` has a role, or with the
        `--kv-transfer-config` `kv_config`); returns it and its base URL (returns at once)."""
        a = self.args
        port = opts.port if opts else free_port_run()
        argv = [
            *serve_argv(sys.executable, self.model),
            "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(a.max_model_len), "--load-format", "dummy",
        ]  # fmt: skip
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
        }
        if a.device == "cpu":
            argv += ["--dtype", "float32", "--enforce-eager", "--distributed-executor-backend"]
            argv += ["uni", "--num-gpu-blocks-override", str(a.cpu_blocks)]
            env.update(LEAN_ENV)
        else:
            argv += ["--dtype", "bfloat16", "--block-size", str(GPU_BLOCK_SIZE)]
            # A fixed KV size: the same budget per instance, and no memory profiling, which
            # fails when instances sharing a GPU start together.
            argv += ["--kv-cache-memory", str(a.kv_cache_memory)]
            argv += ["--gpu-memory-utilization", str(a.gpu_memory_utilization)]
            argv += [] if a.cuda_graphs else ["--enforce-eager"]
            env.update(
                CUDA_VISIBLE_DEVICES=str(gpu),
                NCCL_NVLS_ENABLE="0",
                VLLM_USE_FLASHINFER_SAMPLER="0",
            )
            if a.gpus == 1:  # processes sharing a GPU must look like separate hosts to NCCL
                env["NCCL_HOSTID"] = f"xpyd-{name}"
        if opts is not None and opts.role is not None:
            argv += ["--kv-transfer-config", json.dumps(connector_config(opts))]
            events = self.args.work / f"kvev-{name}"
            events.mkdir(mode=0o700, parents=True, exist_ok=True)
            endpoint = f"ipc://{events / 'kv-events.ipc'}"
            argv += ["--kv-events-config", json.dumps(kv_events_config(endpoint))]
            if token:  # the connector reads its tokens from the environment, not argv
                env.update(PDPLANE_TOKEN=token, PDPLANE_REGISTRY_TOKEN=token)
        if kv_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_config)]
        env.update(env_extra or {})
        log = self.args.work / f"{name}.log"
        proc = ManagedProcess(name, argv, log, env=env)
        proc.start()
        self.procs.append(proc)
        self.logs.append(log)
        url = f"http://127.0.0.1:{port}"
        self.vllms.append((row, name, proc, url))
        return proc, url

    def pdplane(self, name: str, mode: str, gpus: tuple[int, int]) -> tuple[Fleet, Target]:
        """Registry, scheduler and gateway as `pdplane up` starts them, then a 1P1D pair of
        `vllm serve` with the connector registering there (returns before vLLM is up)."""
        a = self.args
        token = secrets.token_urlsafe(24)
        spec = FleetSpec(
            gateway_port=free_port_run(),
            registry_port=free_port_run(),
            scheduler_port=free_port_run(),
            max_model_len=a.max_model_len,
            log_dir=a.work / name,
            token=token,
            admin_token=secrets.token_urlsafe(24),
        )
        fleet = Fleet(spec, say=lambda m: print(f"  [{name}] {m}", flush=True))
        self.fleets.append(fleet)
        fleet.start_services(120)
        self.logs += [spec.log_dir / f"{s}.log" for s in ("registry", "scheduler", "gateway")]
        extra = {"transport": "tcp" if a.device == "cpu" else "nccl", "mode": mode}
        common: dict[str, Any] = {
            "model": self.model,
            "registry": fleet.registry_address,
            "connector_extra": extra,
            "max_model_len": a.max_model_len,
        }
        prefill = VllmCpuOptions(
            port=free_port_run(), role="kv_producer", kv_port=free_port_run(), **common
        )
        decode = VllmCpuOptions(
            port=free_port_run(), role="kv_consumer", kv_port=free_port_run(), **common
        )
        _, prefill_url = self.vllm(name, f"{name}-prefill", gpus[0], prefill, token)
        _, decode_url = self.vllm(name, f"{name}-decode", gpus[1], decode, token)
        return fleet, Target(
            name,
            fleet.gateway_url,
            a.work / f"{name}-decode.log",
            fleet.gateway_url,
            spec.log_dir / "gateway.log",
            {"gateway": fleet.gateway_url, "prefill": prefill_url, "decode": decode_url},
        )

    def nixl_pair(self, gpus: tuple[int, int]) -> dict[str, str]:
        """A 1P1D pair of `vllm serve` with vLLM's `NixlConnector` (`kv_both` on both, as
        vLLM's NIXL P/D examples run it), each its own NIXL side channel; `--nixl-env` (UCX's
        settings) goes to both. Returns {"prefill": url, "decode": url} (returns at once)."""
        urls = {}
        for role, gpu in (("prefill", gpus[0]), ("decode", gpus[1])):
            env = {
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port_run()),
                **self.args.nixl_env_map,
            }
            config = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
            _, urls[role] = self.vllm("nixl", f"nixl-{role}", gpu, None, None, config, env)
        return urls

    def front(self, row: str, pair: dict[str, str]) -> Target:
        """The proxy of a NIXL row before `pair` (started once the pair is healthy): vllm-router
        in its P/D mode, or vLLM's toy proxy; waits until it answers HTTP."""
        port = free_port_run()
        if row == "nixl-router":
            argv = [sys.executable, "-c", "from vllm_router.launch_router import main; main()"]
            argv += ["--vllm-pd-disaggregation", "--policy", "round_robin"]
            argv += ["--prefill", pair["prefill"], "--decode", pair["decode"]]
            argv += ["--host", "127.0.0.1", "--port", str(port)]
            argv += ["--intra-node-data-parallel-size", "1"]
            health = "/health"
        else:
            if self.args.toy_proxy is None:
                raise ValueError("nixl-proxy needs --toy-proxy (vLLM's toy_proxy_server.py)")
            argv = [sys.executable, str(self.args.toy_proxy), "--host", "127.0.0.1"]
            argv += ["--port", str(port), "--prefiller-hosts", "127.0.0.1"]
            argv += ["--prefiller-ports", pair["prefill"].rsplit(":", 1)[1]]
            argv += ["--decoder-hosts", "127.0.0.1"]
            argv += ["--decoder-ports", pair["decode"].rsplit(":", 1)[1]]
            health = "/healthcheck"
        log = self.args.work / f"{row}.log"
        proc = ManagedProcess(row, argv, log, env=dict(os.environ))
        proc.start()
        self.procs.append(proc)
        self.logs.append(log)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(url + health), 120, watch=[proc], what=f"{row} front")
        return Target(row, url, self.args.work / "nixl-decode.log", metrics=dict(pair))

    def gateway(self, fleet: Fleet, name: str, *flags: str) -> Target:
        """Another gateway over `fleet`'s registry and scheduler (unless `flags` name their own
        `--scheduler`), with `flags`."""
        port = free_port_run()
        argv = [sys.executable, "-m", "pdplane.cli.main", "gateway"]
        if "--scheduler" not in flags:
            argv += ["--scheduler", fleet.scheduler_address]
        argv += ["--registry", fleet.registry_address]
        argv += ["--host", "127.0.0.1", "--port", str(port), *flags]
        env = {**os.environ, "PDPLANE_TOKEN": fleet.spec.token or ""}
        log = self.args.work / f"{name}-gateway.log"
        proc = ManagedProcess(f"{name}-gateway", argv, log, env=env)
        proc.start()
        self.procs.append(proc)
        self.logs.append(log)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(f"{url}/health"), 60, watch=[proc], what=f"{name} gateway")
        return Target(name, url, None, url, log)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        for fleet in reversed(self.fleets):
            fleet.stop()


def _answers(url: str) -> bool:
    """True when `url` answers HTTP at all (a 503 /health is an answer)."""
    try:
        urllib.request.urlopen(url, timeout=2).read()
        return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def _health(url: str) -> dict[str, Any]:
    """The JSON body of `url`/health, whatever its status."""
    try:
        body = urllib.request.urlopen(f"{url}/health", timeout=5).read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
    except OSError as exc:
        return {"error": str(exc)}
    try:
        return dict(json.loads(body))
    except ValueError:
        return {"body": body[:2000].decode(errors="replace")}


def _routing(health: dict[str, Any]) -> str | None:
    """The model's "routing" (precise or load) in a gateway's /health body, None if absent."""
    entry = (health.get("models") or {}).get(MODEL)
    return str(entry["routing"]) if isinstance(entry, dict) and "routing" in entry else None


def _precise(url: str) -> bool:
    """True when the gateway at `url` routes the model precisely (it has its tokenizer)."""
    return _routing(_health(url)) == "precise"


def _new_text(log: Path | None, offsets: dict[Path, int]) -> str:
    """What `log` gained since the previous call for it ("" without a log)."""
    if log is None or not log.exists():
        return ""
    with log.open("rb") as f:
        f.seek(offsets.get(log, 0))
        text = f.read().decode(errors="replace")
        offsets[log] = f.tell()
    return text


def _pulls(text: str) -> list[dict[str, float]]:
    """The KV transfers decode's connector logged in `text`: blocks, bytes, ms, and whether
    prefill had pushed them (then ms is decode taking the pushed blocks, not the wire)."""
    return [
        {"blocks": int(b), "bytes": int(n), "ms": float(ms), "pushed": kind != "pulled"}
        for kind, b, n, ms in _PULL_LINE.findall(text)
    ]


def route_counts(text: str) -> dict[str, int]:
    """The gateway's access lines in `text`: requests, and those decode computed alone
    (`prefill=skipped`: the scheduler found the prompt in decode's prefix cache; gateways
    before that wording wrote `prefill=none`)."""
    lines = [ln for ln in text.splitlines() if "pdplane.gateway.access" in ln]
    alone = sum("prefill=skipped" in ln or "prefill=none" in ln for ln in lines)
    return {"requests": len(lines), "decode_alone": alone}


def _histogram_sums(urls: dict[str, str]) -> dict[str, float]:
    """`{"<role> <histogram>{labels} sum|count": value}` of the `_BREAKDOWN` histograms that
    each of `urls` (role -> base URL) exports on /metrics (Prometheus text format, parsed by
    prometheus_client), and `{"first_tokens <source>": count}` of the gateway's first tokens; a
    URL that does not answer adds nothing."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for role, url in urls.items():
        try:
            text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
        except (OSError, ValueError):
            continue
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == _FIRST_TOKENS:
                    key = f"first_tokens {sample.labels.get('source', '')}"
                    out[key] = out.get(key, 0.0) + sample.value
                    continue
                base = sample.name.removesuffix("_sum").removesuffix("_count")
                if base not in _BREAKDOWN or sample.name == base:
                    continue
                labels = ",".join(
                    f"{k}={v}" for k, v in sorted(sample.labels.items()) if k in ("leg",)
                )
                kind = "sum" if sample.name.endswith("_sum") else "count"
                key = f"{role} {base}{{{labels}}} {kind}"
                out[key] = out.get(key, 0.0) + sample.value
    return out


def _breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Mean ms and count per histogram over a cell: (sum after - before) / (count after -
    before); histograms no request of the cell touched are left out."""
    out: dict[str, Any] = {}
    for key, total in after.items():
        if not key.endswith(" sum"):
            continue
        name = key.removesuffix(" sum")
        n = after.get(f"{name} count", 0.0) - before.get(f"{name} count", 0.0)
        if n > 0:
            ms = (total - before.get(key, 0.0)) / n * 1e3
            out[name] = {"mean_ms": round(ms, 2), "count": int(n)}
    return out


def _pull_summary(pulls: list[dict[str, float]], block_size: int) -> dict[str, Any]:
    """Count, medians and ms per 10k tokens (median over transfers) of a cell's transfers."""
    if not pulls:
        return {"count": 0}
    per_10k = [p["ms"] * 1e4 / (p["blocks"] * block_size) for p in pulls if p["blocks"]]
    return {
        "count": len(pulls),
        "pushed": sum(bool(p["pushed"]) for p in pulls),
        "median_blocks": statistics.median(p["blocks"] for p in pulls),
        "median_bytes": statistics.median(p["bytes"] for p in pulls),
        "median_ms": round(statistics.median(p["ms"] for p in pulls), 2),
        "median_ms_per_10k_tokens": round(statistics.median(per_10k), 1) if per_10k else None,
        "gb_per_s": round(sum(p["bytes"] for p in pulls) / sum(p["ms"] for p in pulls) / 1e6, 2),
    }


class Bench:
    """`vllm bench serve` in this process, one cell at a time."""

    def __init__(self, args: argparse.Namespace) -> None:
        from vllm.benchmarks import serve

        self.serve = serve
        self.args = args
        # vLLM's client loads the tokenizer in every run (seconds for a 128k-entry vocabulary):
        # once is enough, the same tokenizer serves every cell.
        load = serve.get_tokenizer
        loaded: dict[str, Any] = {}

        def cached(name: Any, *a: Any, **kw: Any) -> Any:
            key = repr((name, a, sorted(kw.items())))
            if key not in loaded:
                loaded[key] = load(name, *a, **kw)
            return loaded[key]

        serve.get_tokenizer = cached  # type: ignore[assignment]
        self.dir = args.work / "bench"
        self.dir.mkdir(parents=True, exist_ok=True)

    def argv(self, target: Target, input_len: int, concurrency: int) -> list[str]:
        """The `vllm bench serve` arguments of one cell."""
        a = self.args
        prompts = min(a.prompts_per_concurrency * concurrency, a.max_prompts)
        warmups = min(concurrency, a.max_warmups)
        return [
            "--backend", "vllm", "--base-url", target.url, "--model", MODEL,
            "--tokenizer", str(a.model_dir), "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len", str(a.output_len),
            "--ignore-eos", "--max-concurrency", str(concurrency),
            "--num-prompts", str(max(prompts, concurrency)), "--num-warmups", str(warmups),
            "--goodput", f"ttft:{a.goodput_ttft_ms:g}",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--seed", str(_seed(a.seed, target.row, input_len, concurrency)), "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(self.dir),
            "--result-filename", f"{target.row}-in{input_len}-c{concurrency}.json",
            "--label", target.row,
        ]  # fmt: skip

    def run(self, target: Target, input_len: int, concurrency: int) -> dict[str, Any]:
        argv = self.argv(target, input_len, concurrency)
        print(f"$ vllm bench serve {' '.join(argv)}", flush=True)
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = FlexibleArgumentParser()
        self.serve.add_cli_args(parser)
        result = self.serve.main(parser.parse_args(argv))
        # Per-request lists are long (ITLs: prompts x output tokens); TTFTs are kept.
        keep = {k: v for k, v in dict(result).items() if not isinstance(v, list)}
        keep["ttfts_ms"] = [round(float(t) * 1e3, 2) for t in result.get("ttfts", [])]
        keep["argv"] = argv
        return keep


#: rows measured on a pair an earlier row's cells left their prompts cached in -> the offset
#: of their seeds (each its own prompts)
_SECOND_ON_PAIR = {"pdplane-ft-decode": 7, "nixl-proxy": 7, "pdplane-embedded": 11}


def _seed(base: int, row: str, input_len: int, concurrency: int) -> int:
    """A cell's dataset seed: the same prompts for every row on its own instances; other
    prompts for a second row on a pair (`_SECOND_ON_PAIR`), which the first row's cells left
    their prompts cached in."""
    return base + input_len + concurrency + _SECOND_ON_PAIR.get(row, 0)


def _cell_key(row: str, input_len: int, concurrency: int) -> str:
    return f"{row}|{input_len}|{concurrency}"


def _cells(args: argparse.Namespace) -> list[tuple[int, int, str]]:
    """(input length, concurrency, row) in the order they run."""
    lens = [int(x) for x in args.input_lens.split(",")]
    concs = [int(x) for x in args.concurrency.split(",")]
    rows = args.row_list
    cells = []
    for c in concs:
        for n in lens:
            for row in rows:
                if row in (*SECOND_GATEWAYS, "pdplane-push") and c > args.variant_max_c:
                    continue
                cells.append((n, c, row))
    if args.order == "by-length":
        cells.sort(key=lambda t: (lens.index(t[0]), concs.index(t[1])))
    elif args.order == "by-row":
        cells.sort(key=lambda t: (rows.index(t[2]), concs.index(t[1]), lens.index(t[0])))
    else:  # concurrency 1 first (the TTFT comparison), then by length and concurrency
        cells.sort(key=lambda t: (t[1] != min(concs), lens.index(t[0]), concs.index(t[1])))
    return cells


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{float(v):.2f}" if float(v) < 100 else f"{float(v):.1f}"


def table(results: dict[str, Any]) -> str:
    """The seed-format table (markdown) of every measured cell, ratios to `plain` after it."""
    cells = results["cells"]
    lens = sorted({int(k.split("|")[1]) for k in cells})
    concs = sorted({int(k.split("|")[2]) for k in cells})
    rows = [r for r in ROWS if any(k.startswith(r + "|") for k in cells)]
    out = [
        f"Model {results['model']}, {results['device']}; random {', '.join(map(str, lens))} "
        f"tokens in / {results['output_len']} out, goodput = TTFT <= "
        f"{results['goodput_ttft_ms']:g} ms.",
        "",
        "| input | row | c | prompts | " + " | ".join(c for _, c in _COLUMNS) + " |",
        "|---" * (4 + len(_COLUMNS)) + "|",
    ]
    for n in lens:
        for c in concs:
            for row in rows:
                cell = cells.get(_cell_key(row, n, c))
                if cell is None:
                    continue
                vals = " | ".join(_fmt(cell.get(k)) for k, _ in _COLUMNS)
                out.append(f"| {n} | {row} | {c} | {cell.get('completed', '-')} | {vals} |")
    ratios = []
    for n in lens:
        for c in concs:
            base = cells.get(_cell_key("plain", n, c))
            for row in rows:
                cell = cells.get(_cell_key(row, n, c))
                if row == "plain" or base is None or cell is None:
                    continue
                parts = []
                for key, label in (
                    ("request_throughput", "Req/s"),
                    ("request_goodput", "goodput"),
                    ("p50_ttft_ms", "TTFT p50"),
                    ("p50_tpot_ms", "TPOT p50"),
                    ("p50_itl_ms", "ITL p50"),
                ):
                    a, b = cell.get(key), base.get(key)
                    if a is not None and b:
                        parts.append(f"{label} {float(a) / float(b):.2f}x")
                ratios.append(f"- {n} in, c={c}, {row} / plain: " + ", ".join(parts))
    if ratios:
        out += ["", *ratios]
    pulls = [(k, v["pulls"]) for k, v in cells.items() if v.get("pulls", {}).get("count", 0) > 0]
    if pulls:
        out += [
            "",
            "KV transfers (decode's connector log, per cell; pushed: ms is decode taking the "
            "blocks prefill pushed during its forward, not the wire):",
        ]
        for k, p in pulls:
            row, n, c = k.split("|")
            out.append(
                f"- {row} {n} in c={c}: {p['count']} transfers ({p.get('pushed', 0)} pushed), "
                f"median {p['median_blocks']:g} "
                f"blocks / {p['median_bytes'] / 1e6:.1f} MB in {p['median_ms']} ms, "
                f"{p['median_ms_per_10k_tokens']} ms per 10k tokens, {p['gb_per_s']} GB/s"
            )
    spent = [(k, v["breakdown"]) for k, v in cells.items() if v.get("breakdown")]
    if spent:
        out += ["", "Where the time goes (mean ms per request, from each process's /metrics):"]
        for k, b in spent:
            parts = [f"{name.replace('{}', '')} {v['mean_ms']}" for name, v in sorted(b.items())]
            out.append(f"- {k.replace('|', ' ')}: " + "; ".join(parts))
    firsts = [(k, v["first_tokens"]) for k, v in cells.items() if v.get("first_tokens")]
    if firsts:
        out += ["", "First tokens by source (the gateway's streams in the cell, warm-ups too):"]
        out += [
            f"- {k.replace('|', ' ')}: " + ", ".join(f"{s} {n}" for s, n in sorted(f.items()))
            for k, f in firsts
        ]
    stats = [(k, v["nixl_stats"]) for k, v in cells.items() if v.get("nixl_stats")]
    if stats:
        out += ["", "NIXL's transfer statistics (decode's log, the cell's last line):"]
        out += [f"- {k.replace('|', ' ')}: {s[-1][:400]}" for k, s in stats]
    alone = [(k, v["routes"]) for k, v in cells.items() if v.get("routes", {}).get("decode_alone")]
    if alone:
        out += ["", "Requests decode served alone (the prompt was in its prefix cache):"]
        out += [
            f"- {k.replace('|', ' ')}: {r['decode_alone']} of {r['requests']}" for k, r in alone
        ]
    return "\n".join(out) + "\n"


def _save(args: argparse.Namespace, results: dict[str, Any]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    text = table(results)
    (args.out / "table.md").write_text(text)


def _tokenizer_report(launcher: Launcher, targets: list[Target]) -> str:
    """The gateways' /health and every log line about the tokenizer, for `tokenizer.txt`."""
    out = []
    for t in targets:
        if t.gateway_url:
            out.append(f"== {t.row} gateway /health")
            out.append(json.dumps(_health(t.gateway_url), indent=1))
    for log in launcher.logs:
        if not log.exists():
            continue
        lines = [
            ln[:500]
            for ln in log.read_text(errors="replace").splitlines()
            # vLLM's engine config line names the tokenizer too: not that one
            if _TOKENIZER_LINE.search(ln) and "with config:" not in ln
        ]
        out.append(f"== {log.name}: {len(lines)} lines about the tokenizer")
        out += lines[:40]
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="results folder (written as it goes)")
    p.add_argument(
        "--table",
        type=Path,
        nargs="+",
        help="only print the table of these results.json files (cells merged, later ones win)",
    )
    p.add_argument("--work", type=Path, default=Path("/tmp/xpyd-gpu"))
    p.add_argument("--rows", default="plain,pdplane", help=f"comma separated, of {ROWS}")
    p.add_argument("--input-lens", default="1000,8000")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--prompts-per-concurrency", type=int, default=5)
    p.add_argument("--max-prompts", type=int, default=1 << 30)
    p.add_argument("--max-warmups", type=int, default=1 << 30)
    p.add_argument(
        "--variant-max-c",
        type=int,
        default=16,
        help="pdplane-ft-decode, pdplane-embedded and pdplane-push run at concurrencies up to this",
    )
    p.add_argument("--goodput-ttft-ms", type=float, default=1000.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--order", default="c1-first", choices=["c1-first", "by-length", "by-row"])
    p.add_argument("--device", default="gpu", choices=["gpu", "cpu"])
    p.add_argument("--shape", default="llama-3.1-8b", choices=["llama-3.1-8b", "small"])
    p.add_argument("--gpus", type=int, default=1, help="1: every instance on GPU 0")
    p.add_argument("--max-model-len", type=int, default=10240)
    p.add_argument("--kv-cache-memory", type=int, default=16_000_000_000, help="bytes each")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.27)
    p.add_argument("--cpu-blocks", type=int, default=64, help="KV blocks each, --device cpu")
    p.add_argument("--cuda-graphs", action="store_true", help="no --enforce-eager")
    p.add_argument(
        "--toy-proxy",
        type=Path,
        help="vLLM's tests/v1/kv_connector/nixl_integration/toy_proxy_server.py (nixl-proxy)",
    )
    p.add_argument(
        "--nixl-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the NIXL instances (e.g. UCX_TLS=cuda_ipc,cuda_copy,tcp); repeat",
    )
    p.add_argument("--resume", type=Path, help="a previous results.json: skip its cells")
    p.add_argument("--deadline-s", type=float, default=0.0, help="start no cell after this")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--precise-timeout-s", type=float, default=120.0)
    args = p.parse_args()
    if args.table:
        merged: dict[str, Any] = {}
        for path in args.table:
            run = json.loads(path.read_text())
            merged = {**run, "cells": {**merged.get("cells", {}), **run["cells"]}}
        print(table(merged), end="")
        return 0
    if args.out is None:
        p.error("--out is required")
    started = time.monotonic()
    args.row_list = [r for r in args.rows.split(",") if r]
    args.nixl_env_map = dict(kv.split("=", 1) for kv in args.nixl_env)
    unknown = set(args.row_list) - set(ROWS)
    if unknown:
        p.error(f"unknown rows {sorted(unknown)}: choose from {ROWS}")
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    config = LLAMA31_8B_CONFIG if args.shape == "llama-3.1-8b" else SMALL_CONFIG
    tiny = build_tiny_model(args.work / "models")
    args.model_dir = dummy_model(tiny, args.work / args.shape, config)
    results: dict[str, Any] = {
        "model": f"{args.shape} (dummy weights)",
        "device": args.device,
        "output_len": args.output_len,
        "goodput_ttft_ms": args.goodput_ttft_ms,
        "argv": sys.argv[1:],
        "nixl_env": args.nixl_env_map,
        "cells": {},
        "skipped": [],
    }
    if args.resume and args.resume.exists():
        results["cells"] = json.loads(args.resume.read_text()).get("cells", {})
    todo = [c for c in _cells(args) if _cell_key(c[2], c[0], c[1]) not in results["cells"]]
    rows_needed = {r for _, _, r in todo}
    launcher = Launcher(args, args.model_dir)
    targets: dict[str, Target] = {}
    block = GPU_BLOCK_SIZE if args.device == "gpu" else 128
    try:
        if not todo:
            print("nothing to run: every cell is in --resume", flush=True)
            return 0
        decode_gpu = 1 if args.gpus > 1 else 0
        failed: dict[str, str] = {}  # row -> why it cannot run
        if "plain" in rows_needed:
            _, url = launcher.vllm("plain", "plain", 0, None)
            targets["plain"] = Target("plain", url, metrics={"plain": url})
        for row, mode in (("pdplane", "pull"), ("pdplane-push", "push")):
            wanted = {row} | (set(SECOND_GATEWAYS) if row == "pdplane" else set())
            if not rows_needed & wanted:
                continue
            try:
                fleet, t = launcher.pdplane(row, mode, (0, decode_gpu))
                targets[row] = t
                for second in sorted(rows_needed & wanted & set(SECOND_GATEWAYS)):
                    g = launcher.gateway(fleet, second, *SECOND_GATEWAYS[second])
                    targets[g.row] = replace(
                        g,
                        decode_log=t.decode_log,
                        metrics={**t.metrics, "gateway": g.url},
                    )
            except Exception as exc:  # the other rows still run
                for r in wanted:
                    failed[r] = f"{type(exc).__name__}: {exc}"
        nixl_pair = None
        if rows_needed & set(NIXL_ROWS):
            nixl_pair = launcher.nixl_pair((0, decode_gpu))
        for row, name, proc, url in launcher.vllms:
            try:
                wait_until(
                    functools.partial(http_ok, f"{url}/health"),
                    args.startup_timeout_s,
                    watch=[proc],
                    what=f"vLLM {name}",
                )
            except Exception as exc:  # this row cannot run; the others still do
                why = f"{type(exc).__name__}: {exc}"
                for r in [
                    r
                    for r in (*targets, *NIXL_ROWS)
                    if r == row
                    or (row == "pdplane" and r in SECOND_GATEWAYS)
                    or (row == "nixl" and r in NIXL_ROWS and r in rows_needed)
                ]:
                    failed[r] = why
                print(f"{name} did not start: {why}\n{proc.tail(40)}", flush=True)
        for r in NIXL_ROWS:
            if r in rows_needed and r not in failed and nixl_pair is not None:
                try:
                    targets[r] = launcher.front(r, nixl_pair)
                except Exception as exc:  # the exact error is the row's result
                    failed[r] = f"{type(exc).__name__}: {exc}"
                    print(f"{r} did not start: {failed[r]}", flush=True)
                    for proc in launcher.procs:
                        if proc.name == r:
                            print(proc.tail(40), flush=True)
        for r in failed:
            targets.pop(r, None)
        results["failed_rows"] = failed
        results["startup_s"] = round(time.monotonic() - started, 1)
        print(f"every instance healthy after {results['startup_s']} s", flush=True)
        gateways = [t for t in targets.values() if t.gateway_url]
        routing: dict[str, Any] = {}
        for t in gateways:
            assert t.gateway_url is not None
            gw = t.gateway_url
            try:
                wait_until(
                    functools.partial(_precise, gw),
                    args.precise_timeout_s,
                    what=f"{t.row} gateway: routing precise for {MODEL}",
                )
            except TimeoutError as exc:
                print(f"not precise: {exc}", flush=True)
            health = _health(gw)
            routing[t.row] = {"routing": _routing(health), "health": health}
            print(f"{t.row} gateway /health routing: {routing[t.row]['routing']}", flush=True)
        results["routing"] = routing
        results["precise_s"] = round(time.monotonic() - started, 1)
        (args.out / "tokenizer.txt").write_text(_tokenizer_report(launcher, list(targets.values())))
        _save(args, results)
        bench = Bench(args)
        offsets: dict[Path, int] = {}
        for n, c, row in todo:
            if args.deadline_s and time.monotonic() - started > args.deadline_s:
                results["skipped"].append(_cell_key(row, n, c))
                continue
            if row not in targets:
                results["skipped"].append(_cell_key(row, n, c))
                continue
            target = targets[row]
            for log in (target.decode_log, target.gateway_log):  # skip what came before
                _new_text(log, offsets)
            sums = _histogram_sums(target.metrics)
            t0 = time.monotonic()
            try:
                cell = bench.run(target, n, c)
            except Exception as exc:  # the other cells still run
                cell = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"cell {row} {n} c={c} failed: {cell['error']}", flush=True)
            cell["wall_s"] = round(time.monotonic() - t0, 1)
            after = _histogram_sums(target.metrics)
            cell["breakdown"] = _breakdown(sums, after)
            firsts = {
                k.split(" ", 1)[1]: int(v - sums.get(k, 0.0))
                for k, v in after.items()
                if k.startswith("first_tokens ")
            }
            if firsts:
                cell["first_tokens"] = firsts
            if target.decode_log is not None:
                text = _new_text(target.decode_log, offsets)
                cell["pulls"] = _pull_summary(_pulls(text), block)
                if row in NIXL_ROWS:
                    cell["nixl_stats"] = _NIXL_STATS_LINE.findall(text)[-6:]
            if target.gateway_log is not None:
                cell["routes"] = route_counts(_new_text(target.gateway_log, offsets))
            results["cells"][_cell_key(row, n, c)] = cell
            _save(args, results)
            print(table(results), flush=True)
        results["routing_after"] = {
            t.row: _routing(_health(t.gateway_url)) for t in gateways if t.gateway_url
        }
    except Exception as exc:
        results["error"] = f"{type(exc).__name__}: {exc}"
        print(f"error: {results['error']}", flush=True)
        for proc in launcher.procs:
            print(f"--- {proc.name}\n{proc.tail(25)}", flush=True)
    finally:
        results["total_s"] = round(time.monotonic() - started, 1)
        _save(args, results)
        launcher.stop()
        with tarfile.open(args.out / "logs.tgz", "w:gz") as tar:
            for log in launcher.logs:
                if log.exists():
                    same = log.parent == args.work
                    tar.add(log, arcname=log.name if same else f"{log.parent.name}-{log.name}")
    return 0 if "error" not in results else 1


if __name__ == "__main__":
    sys.exit(main())
