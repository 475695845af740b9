"""Invalid InstanceSpec fields, each with the field path its error must name (shared by the
unit tests of validation and the registry's gRPC tests)."""

from __future__ import annotations

from typing import Any

from pdplane.v1 import instance_pb2

__all__ = ["BAD_SPECS"]


def _layout(**kw: Any) -> instance_pb2.KvLayout:
    base = {"num_layers": 2, "num_kv_heads": 2, "head_size": 32, "block_size": 16}
    return instance_pb2.KvLayout(**{**base, "dtype": "float32", **kw})


BAD_SPECS: list[tuple[str, dict[str, Any]]] = [
    ("spec.instance_id", {"instance_id": ""}),
    ("spec.instance_id", {"instance_id": "has space"}),
    ("spec.instance_id", {"instance_id": "x" * 129}),
    ("spec.role", {"role": instance_pb2.ROLE_UNSPECIFIED}),
    ("spec.role", {"role": 7}),
    ("spec.model", {"model": ""}),
    ("spec.model", {"model": "two words"}),
    ("spec.url", {"url": ""}),
    ("spec.url", {"url": "ftp://127.0.0.1:8100"}),
    ("spec.url", {"url": "http://127.0.0.1"}),
    ("spec.url", {"url": "http://127.0.0.1:8100/v1"}),
    ("spec.url", {"url": "http://127.0.0.1:99999"}),
    ("spec.url", {"url": "not a url"}),
    ("spec.kv_endpoint", {"kv_endpoint": ""}),
    ("spec.kv_endpoint", {"kv_endpoint": "127.0.0.1"}),
    ("spec.kv_endpoint", {"kv_endpoint": "127.0.0.1:0"}),
    ("spec.kv_endpoint", {"kv_endpoint": "127.0.0.1:70000"}),
    ("spec.kv_endpoint", {"kv_endpoint": "bad host!:80"}),
    ("spec.transport", {"transport": instance_pb2.TRANSPORT_UNSPECIFIED}),
    ("spec.transport", {"transport": 9}),
    ("spec.tp_size", {"tp_size": 0}),
    ("spec.tp_size", {"tp_size": 100_000}),
    ("spec.max_model_len", {"max_model_len": 0}),
    ("spec.max_model_len", {"max_model_len": 1 << 30}),
    ("spec.kv_layout.num_layers", {"kv_layout": _layout(num_layers=0)}),
    ("spec.kv_layout.num_kv_heads", {"kv_layout": _layout(num_kv_heads=1 << 20)}),
    ("spec.kv_layout.head_size", {"kv_layout": _layout(head_size=0)}),
    ("spec.kv_layout.block_size", {"kv_layout": _layout(block_size=0)}),
    ("spec.kv_layout.dtype", {"kv_layout": _layout(dtype="float99")}),
    ("spec.labels", {"labels": {"bad key!": "v"}}),
    ("spec.labels", {"labels": {f"k{i}": "v" for i in range(65)}}),
    ("spec.version", {"version": "v" * 300}),
]
