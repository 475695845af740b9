"""An instance as the scheduler sees it: a flat, immutable copy of the fields a decision reads.

Decisions read these attributes many times per request; copying them out of the protobuf once
per registry revision keeps the hot path to plain attribute access.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdplane.core.instance.pairing import PairKey, can_decode, can_prefill, pair_key
from pdplane.v1 import instance_pb2

__all__ = ["Candidate", "PairKey"]


@dataclass(frozen=True, slots=True)
class Candidate:
    """One registered instance with its latest load report.

    Token counts in tokens, KV sizes in KV cache blocks, `kv_cache_usage` a fraction 0..1.
    `revision` is the registry revision of the instance's last change; `epoch` identifies this
    load report (registration time and revision together, so a restarted registry that reuses
    revision numbers still starts new epochs; the lease id, which once served, is never listed).
    """

    instance_id: str
    model: str
    url: str
    kv_endpoint: str
    transport: instance_pb2.Transport.ValueType
    fingerprint: str
    block_size: int
    max_model_len: int
    can_prefill: bool
    can_decode: bool
    serving: bool
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    free_kv_blocks: int
    total_kv_blocks: int
    revision: int
    epoch: int
    #: What must match between a prefill and its decode instance.
    pair_key: PairKey
    #: Reported running + waiting requests plus KV cache usage (0..1) as a tie-breaker.
    reported_load: float
    #: Push mode (decode): receive buffer size and the largest push it takes now (bytes);
    #: capacity 0 = the instance takes no pushes. Bytes of one KV cache block (all layers).
    recv_capacity_bytes: int = 0
    recv_headroom_bytes: int = 0
    kv_block_bytes: int = 0

    @classmethod
    def from_instance(cls, instance: instance_pb2.Instance) -> Candidate:
        """Copies the scheduling-relevant fields out of a registry `Instance`."""
        spec, load = instance.spec, instance.load
        key = pair_key(spec)
        return cls(
            instance_id=spec.instance_id,
            model=spec.model,
            url=spec.url,
            kv_endpoint=spec.kv_endpoint,
            transport=spec.transport,
            fingerprint=key[0],
            block_size=spec.kv_layout.block_size,
            max_model_len=spec.max_model_len,
            can_prefill=can_prefill(spec.role),
            can_decode=can_decode(spec.role),
            serving=instance.state == instance_pb2.INSTANCE_STATE_SERVING,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            kv_cache_usage=load.kv_cache_usage,
            free_kv_blocks=load.free_kv_blocks,
            total_kv_blocks=load.total_kv_blocks,
            revision=instance.revision,
            epoch=hash((instance.registered_at.ToNanoseconds(), instance.revision)),
            pair_key=key,
            reported_load=load.num_running + load.num_waiting + load.kv_cache_usage,
            recv_capacity_bytes=load.recv_buffer_capacity_bytes,
            recv_headroom_bytes=load.recv_buffer_headroom_bytes,
            kv_block_bytes=load.kv_block_bytes,
        )
