"""What the connector reads from vLLM's configuration: KV layout, role, model, versions.

Tolerant of vLLM version differences (0.26 .. 0.33): every attribute that moved between
versions is read with a fallback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdplane.v1 import instance_pb2

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "ROLES",
    "data_parallel_rank",
    "kv_layout",
    "served_model_name",
    "software_version",
    "tp_rank",
]

#: vLLM kv_role -> registry role
ROLES: dict[str, instance_pb2.Role.ValueType] = {
    "kv_producer": instance_pb2.ROLE_PREFILL,
    "kv_consumer": instance_pb2.ROLE_DECODE,
    "kv_both": instance_pb2.ROLE_BOTH,
}


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def kv_layout(vllm_config: VllmConfig, kv_cache_config: Any | None) -> instance_pb2.KvLayout:
    """This instance's KV layout (per TP rank), from the KV cache config when vLLM gives one,
    else from the model/cache config. Scheduler and worker sides compute the same value."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if groups:
        spec = groups[0].kv_cache_spec
        return instance_pb2.KvLayout(
            num_layers=sum(len(g.layer_names) for g in groups),
            num_kv_heads=int(getattr(spec, "num_kv_heads", 1)),
            head_size=int(getattr(spec, "head_size", 0)),
            block_size=int(spec.block_size),
            dtype=_dtype_name(getattr(spec, "dtype", "")),
        )
    model, cache, parallel = (
        vllm_config.model_config,
        vllm_config.cache_config,
        vllm_config.parallel_config,
    )
    cache_dtype = getattr(cache, "cache_dtype", "auto")
    return instance_pb2.KvLayout(
        num_layers=int(model.get_num_layers(parallel)),
        num_kv_heads=int(model.get_num_kv_heads(parallel)),
        head_size=int(model.get_head_size()),
        block_size=int(cache.block_size or 0),
        dtype=_dtype_name(model.dtype if cache_dtype == "auto" else cache_dtype),
    )


def served_model_name(vllm_config: VllmConfig) -> str:
    """The model name clients use (first served name, else the model path)."""
    model = vllm_config.model_config
    names = getattr(model, "served_model_name", None)
    if isinstance(names, (list, tuple)):
        names = names[0] if names else None
    return str(names or model.model)


def software_version() -> str:
    """e.g. "vllm 0.32.0 / pdplane 0.1.0"."""
    from importlib.metadata import PackageNotFoundError, version

    import vllm

    try:
        ours = version("pdplane")
    except PackageNotFoundError:
        ours = "dev"
    return f"vllm {getattr(vllm, '__version__', '?')} / pdplane {ours}"


def tp_rank() -> int:
    """This worker's tensor-parallel rank (0 when vLLM's parallel state is not set up)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # parallel state not initialised (tests, single process)
        return 0


def data_parallel_rank(vllm_config: Any) -> int:
    """This engine's data-parallel rank, as vLLM numbers its KV event publishers (0.32's
    `data_parallel_index`, older releases' `data_parallel_rank`); 0 without DP."""
    parallel = getattr(vllm_config, "parallel_config", None)
    for name in ("data_parallel_index", "data_parallel_rank"):
        value = getattr(parallel, name, None)
        if isinstance(value, int):
            return value
    return 0
