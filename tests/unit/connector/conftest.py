"""Builders of vLLM's real scheduler types for the connector's unit tests."""

from __future__ import annotations

from typing import Any

import pytest

from pdplane.v1 import instance_pb2

BLOCK = 4  # tokens per block in these tests (keeps prompts short)


@pytest.fixture
def layout() -> instance_pb2.KvLayout:
    return instance_pb2.KvLayout(
        num_layers=2, num_kv_heads=2, head_size=8, block_size=BLOCK, dtype="float32"
    )


def make_request(
    req_id: str, num_tokens: int, kv_transfer_params: dict[str, Any] | None = None
) -> Any:
    """A real `vllm.v1.request.Request` with `num_tokens` prompt tokens."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return Request(
        request_id=req_id,
        prompt_token_ids=list(range(10, 10 + num_tokens)),
        sampling_params=SamplingParams(max_tokens=4, extra_args=extra),
        pooling_params=None,
    )


def make_blocks(block_ids: list[int]) -> Any:
    """A real `KVCacheBlocks` (one KV cache group) holding `block_ids` in order."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks((tuple(KVCacheBlock(b) for b in block_ids),))
