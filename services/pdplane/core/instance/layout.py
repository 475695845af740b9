"""KV layout fingerprints: two instances exchange KV blocks only when these are equal."""

from __future__ import annotations

from pdplane.v1 import instance_pb2

__all__ = ["fingerprint"]


def fingerprint(layout: instance_pb2.KvLayout) -> str:
    """Canonical string of a KvLayout, e.g. "L2.H2.D32.B128.float32".

    L = layers, H = KV heads per TP rank, D = head size (elements), B = block size (tokens),
    then the torch dtype name.
    """
    return (
        f"L{layout.num_layers}.H{layout.num_kv_heads}.D{layout.head_size}"
        f".B{layout.block_size}.{layout.dtype}"
    )
