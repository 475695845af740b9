"""Named engine profiles: the cost model of one engine step and the engine's capacity.

Step time (ms) of a batch, a roofline-shaped sum in the manner of Vidur (operator costs from
profiles) reduced to a handful of terms that a calibration run can fit::

    t = step_ms                                   # scheduling, launch, sampling set-up
      + max(weights_ms, token_ms * T)             # linear layers: weight reads or compute
      + prefill_token_ms * P                      # per prompt token, on top (CPU fits)
      + seq_ms * S                                # per sequence (sampling, bookkeeping)
      + kv_read_ms_per_ktok * C / 1000            # decode attention: KV read
      + prefill_attn_ms_per_mpair * Q / 1e6       # prefill attention: query-key pairs

T = tokens computed in the step (prefill chunks + one per decode), P = the prefill part of T,
S = sequences in the batch, C = context tokens the decodes attend over, Q = sum over prefill
chunks of chunk x (tokens before it + chunk / 2).

Sources of every number are in each profile's `sources` and in docs/sim.md. GPU profiles are
derived from datasheet bandwidth and compute with stated efficiency assumptions until a
measured profile (`bench/sim/calibrate.py --gpu`) replaces them; a measured profile is a JSON
file of this shape (`load_profile(path)`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PROFILES", "CostModel", "Profile", "kv_bytes_per_token", "load_profile"]

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8": 1, "auto": 2}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_size: int, dtype: str) -> int:
    """Bytes of K and V one token occupies across all layers (2 x layers x heads x size x dtype)."""
    return 2 * num_layers * num_kv_heads * head_size * _DTYPE_BYTES.get(dtype, 2)


@dataclass(frozen=True, slots=True)
class CostModel:
    """Coefficients of the step-time formula above (all ms)."""

    step_ms: float = 0.0
    weights_ms: float = 0.0
    token_ms: float = 0.0
    prefill_token_ms: float = 0.0
    seq_ms: float = 0.0
    kv_read_ms_per_ktok: float = 0.0
    prefill_attn_ms_per_mpair: float = 0.0
    #: not a step cost: from a request's arrival at the HTTP server to its entry into the
    #: scheduler (API server parsing and tokenization, the hop to the engine core), paid by
    #: every request in parallel
    request_ms: float = 0.0
    #: not a step cost: per request, time on the API server's single FIFO before
    #: `request_ms` (a burst of k requests reaches the engine at 1..k x this; 0 = none);
    #: `pdplane.sim.frontend`
    serial_request_ms: float = 0.0

    def step_time_ms(
        self, tokens: int, prefill_tokens: int, seqs: int, context: int, pairs: float
    ) -> float:
        """Modelled duration (ms) of one step; 0 for an empty batch."""
        if not seqs:
            return 0.0
        return (
            self.step_ms
            + max(self.weights_ms, self.token_ms * tokens)
            + self.prefill_token_ms * prefill_tokens
            + self.seq_ms * seqs
            + self.kv_read_ms_per_ktok * context * 1e-3
            + self.prefill_attn_ms_per_mpair * pairs * 1e-6
        )

    @property
    def is_zero(self) -> bool:
        """True when every step takes no time (steps only yield to the event loop)."""
        return not any(dataclasses.astuple(self))


@dataclass(frozen=True, slots=True)
class Profile:
    """A model on a device: step costs, engine limits, KV layout and transfer speed.

    Attributes:
        name, description: how it is named and what it models.
        cost: the step-time coefficients.
        max_num_seqs, max_num_batched_tokens: vLLM's `--max-num-seqs` / token budget per step.
        block_size, num_blocks: KV cache block size (tokens) and blocks (`num_gpu_blocks`).
        num_layers, num_kv_heads, head_size, kv_dtype: the KV layout (sizes in bytes follow).
        max_model_len: context length (tokens).
        transfer_gbps, transfer_latency_ms: KV pull speed between two instances (GB/s) and the
            fixed cost of one transfer (control round trips, ms).
        push_buffer_bytes: decode's receive buffer in push mode (bytes).
        sources: where each number comes from (docs/sim.md repeats them).
    """

    name: str
    description: str
    cost: CostModel
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_blocks: int = 8192
    num_layers: int = 2
    num_kv_heads: int = 2
    head_size: int = 32
    kv_dtype: str = "float32"
    max_model_len: int = 4096
    transfer_gbps: float = 0.0
    transfer_latency_ms: float = 0.0
    push_buffer_bytes: int = 256 << 20
    sources: tuple[str, ...] = field(default=())

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_size, self.kv_dtype)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["sources"] = list(self.sources)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Profile:
        """The profile of a decoded JSON object (`to_dict()` shape). Raises ValueError saying
        what is wrong: not an object, a missing or unknown field, a field of the wrong type or
        out of range (`_check_values`)."""
        if not isinstance(d, dict):
            raise ValueError(f"must be a JSON object, not {_json_kind(d)}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown profile fields: {', '.join(sorted(unknown))}")
        if "cost" not in d:
            raise ValueError("missing key 'cost'")
        data = dict(d)
        cost = data["cost"]
        if not isinstance(cost, dict):
            raise ValueError(f"'cost' must be an object, not {_json_kind(cost)}")
        for key in ("name", "description"):
            if key not in d:
                raise ValueError(f"missing key {key!r}")
        cost_known = {f.name for f in dataclasses.fields(CostModel)}
        if set(cost) - cost_known:
            raise ValueError(f"unknown cost fields: {', '.join(sorted(set(cost) - cost_known))}")
        sources = data.get("sources", [])
        if not isinstance(sources, list) or not all(isinstance(x, str) for x in sources):
            raise ValueError("'sources' must be a list of strings")
        data["cost"] = CostModel(**cost)
        data["sources"] = tuple(sources)
        profile = cls(**data)
        _check_values(profile)
        return profile


#: fields counted in whole units that must be at least one (a zero would divide or deadlock)
_AT_LEAST_ONE = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "num_blocks",
    "num_layers",
    "num_kv_heads",
    "head_size",
    "max_model_len",
    "push_buffer_bytes",
)


def _check_values(p: Profile) -> None:
    """Raises ValueError naming the first field out of range: every cost term and the transfer
    speed / latency a finite number >= 0, every capacity an integer >= 1, max_model_len at
    least one block, names and kv_dtype strings."""

    def number(field_name: str, value: object) -> None:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or value < 0:  # type: ignore[arg-type,operator]
            raise ValueError(f"{field_name} must be a finite number >= 0 (got {value!r})")

    for f in dataclasses.fields(CostModel):
        number(f"cost.{f.name}", getattr(p.cost, f.name))
    number("transfer_gbps", p.transfer_gbps)
    number("transfer_latency_ms", p.transfer_latency_ms)
    for name in _AT_LEAST_ONE:
        value = getattr(p, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
    if p.max_model_len < p.block_size:
        raise ValueError(
            f"max_model_len ({p.max_model_len}) must be >= block_size ({p.block_size})"
        )
    for name in ("name", "description", "kv_dtype"):
        if not isinstance(getattr(p, name), str):
            raise ValueError(f"{name} must be a string (got {getattr(p, name)!r})")


def _json_kind(value: Any) -> str:
    """How JSON names the type of a decoded value ("a list", "a string", ...)."""
    if isinstance(value, bool):
        return "a boolean"
    kinds = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number"}
    return kinds.get(type(value), "null")


# --- GPU profiles derived from datasheets ------------------------------------------------
# Efficiency assumptions (replaced by a measured profile when one exists): memory-bound phases
# reach 75 % of peak HBM bandwidth, compute-bound linear layers 50 % of dense BF16 peak,
# prefill attention 40 %.
_MBU, _MFU, _ATTN_FU = 0.75, 0.5, 0.4


def _gpu_cost(
    params_b: float,
    layers: int,
    heads: int,
    head_size: int,
    kv_bytes: int,
    hbm_tbps: float,
    bf16_tflops: float,
    step_ms: float,
    seq_ms: float,
) -> CostModel:
    weights_bytes = params_b * 1e9 * 2  # bf16
    return CostModel(
        step_ms=step_ms,
        weights_ms=weights_bytes / (hbm_tbps * 1e12 * _MBU) * 1e3,
        token_ms=2 * params_b * 1e9 / (bf16_tflops * 1e12 * _MFU) * 1e3,
        seq_ms=seq_ms,
        kv_read_ms_per_ktok=1000 * kv_bytes / (hbm_tbps * 1e12 * _MBU) * 1e3,
        # QK^T and PV: 4 x layers x heads x head_size FLOPs per query-key pair.
        prefill_attn_ms_per_mpair=1e6
        * 4
        * layers
        * heads
        * head_size
        / (bf16_tflops * 1e12 * _ATTN_FU)
        * 1e3,
    )


_LLAMA3_8B: dict[str, Any] = {
    "num_layers": 32,
    "num_kv_heads": 8,
    "head_size": 128,
    "kv_dtype": "bfloat16",
}
_LLAMA3_8B_KV = kv_bytes_per_token(32, 8, 128, "bfloat16")  # 131072 B
_QWEN2_7B: dict[str, Any] = {
    "num_layers": 28,
    "num_kv_heads": 4,
    "head_size": 128,
    "kv_dtype": "bfloat16",
}
_QWEN2_7B_KV = kv_bytes_per_token(28, 4, 128, "bfloat16")  # 57344 B

_SRC_LLAMA = "Llama-3-8B config.json: 8.03e9 params, 32 layers, 32 heads, 8 KV heads, head 128"
_SRC_H100 = "NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3, 989 TFLOPS dense BF16, 80 GB"
_SRC_H200 = "NVIDIA H200 SXM datasheet: 4.8 TB/s HBM3e, 989 TFLOPS dense BF16, 141 GB"
_SRC_A100 = "NVIDIA A100 SXM 80GB datasheet: 2.039 TB/s HBM2e, 312 TFLOPS dense BF16"
_SRC_EFF = (
    "assumed efficiencies: 75 % of HBM bandwidth (decode), 50 % of BF16 peak (linear layers), "
    "40 % (prefill attention); step overhead 1.5 ms, 0.01 ms per sequence"
)
_SRC_VLLM = (
    "vLLM 0.32 engine/arg_utils.py defaults for the OpenAI server: H100/H200 8192 batched "
    "tokens and 1024 sequences, A100 2048 and 256, CPU 2048 and 128"
)
_SRC_NVLINK = "KV pull over NVLink 4: 900 GB/s per GPU peak, 300 GB/s assumed achieved"


def _blocks(total_gb: float, weights_gb: float, util: float, kv_bytes: int, block: int) -> int:
    return int((total_gb * util - weights_gb - 2.0) * 1e9 / (kv_bytes * block))


def _llama3_8b(gpu: str, label: str, memory_gb: float, hbm_tbps: float, source: str) -> Profile:
    return Profile(
        name=f"llama3-8b-{gpu}",
        description=f"Llama-3-8B, bf16, one {label}, vLLM defaults, gpu util 0.9",
        cost=_gpu_cost(8.03, 32, 32, 128, _LLAMA3_8B_KV, hbm_tbps, 989.0, 1.5, 0.01),
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        block_size=16,
        num_blocks=_blocks(memory_gb, 16.06, 0.9, _LLAMA3_8B_KV, 16),
        max_model_len=8192,
        transfer_gbps=300.0,
        transfer_latency_ms=2.4,
        push_buffer_bytes=1 << 30,
        sources=(
            _SRC_LLAMA,
            source,
            _SRC_EFF,
            _SRC_VLLM,
            _SRC_NVLINK,
            "transfer_latency_ms: pdplane NCCL 1-block pull control cost (docs/nccl.md)",
        ),
        **_LLAMA3_8B,
    )


PROFILES: dict[str, Profile] = {
    "zero": Profile(
        name="zero",
        description="every step takes no time (protocol tests, proxy overhead benchmarks)",
        cost=CostModel(),
    ),
    "tiny-cpu": Profile(
        name="tiny-cpu",
        description="pdplane.models.tiny (2 layers, hidden 128, fp32) on vLLM CPU 0.32, "
        "2-core AVX2 host, lean flags (eager, uni executor), one core",
        # Refitted by bench/sim/calibrate.py --fit on this machine from the 2026-12-01 run of
        # docs/benchmarks/sim.md ("On the CPU"); the earlier fit's ITL was ~2.3x the measured one.
        cost=CostModel(
            step_ms=2.07,
            token_ms=0.00729,
            prefill_token_ms=0.0065,
            seq_ms=0.0924,
            kv_read_ms_per_ktok=0.0246,
            prefill_attn_ms_per_mpair=0.0,
            request_ms=5.88,
        ),
        max_num_seqs=128,
        max_num_batched_tokens=2048,
        block_size=128,
        num_blocks=512,
        max_model_len=1024,
        sources=("measured: bench/sim/calibrate.py (docs/benchmarks/sim.md, calibration)",),
    ),
    "llama3-8b-h100": _llama3_8b("h100", "H100 SXM 80 GB", 80, 3.35, _SRC_H100),
    "llama3-8b-h200": _llama3_8b("h200", "H200 SXM 141 GB", 141, 4.8, _SRC_H200),
    # Fitted by bench/sim/gpu_profile.sh (bench/sim/calibrate.py --target gpu) to vLLM 0.26
    # serving a Llama-3-8B-shaped model with random weights on one H200, 2026-12-01: median
    # error TTFT 6.1 % / ITL 0.8 % on the 9 fitted cells, 13.8 % / 1.4 % out of sample
    # (docs/benchmarks/sim.md, "On the GPU"). Limits and transfer terms as the datasheet one.
    "llama3-8b-h200-measured": dataclasses.replace(
        _llama3_8b("h200", "H200 SXM 141 GB", 141, 4.8, _SRC_H200),
        name="llama3-8b-h200-measured",
        cost=CostModel(
            step_ms=0.338,
            weights_ms=4.46,
            token_ms=0.0221,
            prefill_token_ms=0.0,
            seq_ms=0.0101,
            kv_read_ms_per_ktok=0.0388,
            prefill_attn_ms_per_mpair=0.788,
            request_ms=10.5,
        ),
        num_blocks=56080,
        sources=(
            _SRC_LLAMA,
            "measured: bench/sim/gpu_profile.sh on one H200, vLLM 0.26, --load-format dummy, "
            "fit score 0.055 over 9 cells (docs/benchmarks/sim.md, calibration on the GPU)",
            "num_blocks: vLLM's own KV cache size at --gpu-memory-utilization 0.9 in that run",
            _SRC_VLLM,
            _SRC_NVLINK,
        ),
    ),
    "qwen2-7b-a100": Profile(
        name="qwen2-7b-a100",
        description="Qwen2-7B, bf16, one A100 SXM 80 GB (the seed's 1P7D deployment)",
        cost=_gpu_cost(7.62, 28, 28, 128, _QWEN2_7B_KV, 2.039, 312.0, 1.5, 0.01),
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        block_size=16,
        num_blocks=_blocks(80, 15.24, 0.9, _QWEN2_7B_KV, 16),
        max_model_len=8192,
        transfer_gbps=25.0,
        transfer_latency_ms=2.4,
        # vLLM P2pNcclConnector's default kv_buffer_size (1e9 bytes).
        push_buffer_bytes=1_000_000_000,
        sources=(
            "Qwen2-7B config.json: 7.62e9 params, 28 layers, 28 heads, 4 KV heads, head 128",
            _SRC_A100,
            _SRC_EFF,
            _SRC_VLLM,
            "transfer: 200 Gb/s RDMA NIC (25 GB/s) between nodes, assumed",
            "push_buffer_bytes: vLLM P2pNcclConnector kv_buffer_size default 1e9",
        ),
        **_QWEN2_7B,
    ),
}


def load_profile(name_or_path: str) -> Profile:
    """A profile by name (`PROFILES`) or from a JSON file (`Profile.to_dict()` shape).

    Raises ValueError: "profile file FILE does not exist" / "... is a directory" for a path
    (it has a "/" or ends in ".json") that is not a file, "profile FILE: <what is wrong>" for a
    file that is not UTF-8 JSON of a profile, and "unknown profile NAME; known: ..." otherwise.
    """
    profile = PROFILES.get(name_or_path)
    if profile is not None:
        return profile
    path = Path(name_or_path)
    if path.is_dir():
        raise ValueError(f"profile file {path} is a directory")
    if path.is_file():
        try:
            text = path.read_bytes().decode()
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"profile {path}: not UTF-8 JSON ({exc.reason} at byte {exc.start})"
            ) from None
        except OSError as exc:
            raise ValueError(f"profile file {path}: {exc.strerror or exc}") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"profile {path}: not JSON: {exc}") from exc
        try:
            return Profile.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"profile {path}: {exc}") from exc
    if path.suffix == ".json" or "/" in name_or_path:
        raise ValueError(f"profile file {path} does not exist")
    raise ValueError(f"unknown profile {name_or_path!r}; known: {', '.join(PROFILES)} or a .json")
