"""Which instances may serve which half of a request, and which pairs may exchange KV.

DESIGN: pairs whose KV layout fingerprints, transports or max model lengths differ are never
paired. The scheduler decides with these rules and the gateway's /health reports with them, so
both read them from here.
"""

from __future__ import annotations

from pdplane.core.instance.layout import fingerprint
from pdplane.v1 import instance_pb2

__all__ = ["PairKey", "can_decode", "can_prefill", "pair_key"]

#: Two instances can be paired only when these are equal: KV layout fingerprint, transport
#: (enum value) and max model length (tokens).
PairKey = tuple[str, instance_pb2.Transport.ValueType, int]

_PREFILL_ROLES = (instance_pb2.ROLE_PREFILL, instance_pb2.ROLE_BOTH)
_DECODE_ROLES = (instance_pb2.ROLE_DECODE, instance_pb2.ROLE_BOTH)


def can_prefill(role: instance_pb2.Role.ValueType) -> bool:
    """Whether an instance of `role` computes prompts for others (PREFILL or BOTH)."""
    return role in _PREFILL_ROLES


def can_decode(role: instance_pb2.Role.ValueType) -> bool:
    """Whether an instance of `role` generates from KV computed elsewhere (DECODE or BOTH)."""
    return role in _DECODE_ROLES


def pair_key(spec: instance_pb2.InstanceSpec) -> PairKey:
    """What must be equal between a prefill and its decode instance (see `PairKey`)."""
    return (fingerprint(spec.kv_layout), spec.transport, spec.max_model_len)
