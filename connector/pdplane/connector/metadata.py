"""What the scheduler-side half tells the worker-side half each engine step (one way).

With vLLM's `uni` executor the metadata object is handed over by reference; other executors
serialise it. So these are plain frozen dataclasses of JSON-like values, never mutated after
`build_connector_meta` returns them. Bump `METADATA_VERSION` on any change of their fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = [
    "METADATA_VERSION",
    "HoldSpec",
    "LoadSpec",
    "PdPlaneConnectorMetadata",
    "PushSpec",
    "ReleaseSpec",
]

METADATA_VERSION = 4


@dataclass(frozen=True, slots=True)
class HoldSpec:
    """Prefill: keep `block_ids` for `transfer_id` until completed, aborted or `timeout_s`;
    then report `req_id` (vLLM's id) as finished sending, once. `decode_id`: the decode
    instance the gateway named for it, when it did (its leaving the registry ends the hold)."""

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    timeout_s: float
    decode_id: str = ""


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Decode: pull prefill's blocks at `remote_block_indices` of `transfer_id` from
    `endpoint` into `local_block_ids` (same length); then report `req_id` as finished
    receiving, once (with the local blocks as load errors on failure). `pushed`: prefill
    (instance `sender_id`) pushed them into this worker's receive buffer: take them from
    there, and pull only if that push is unusable."""

    req_id: str
    transfer_id: str
    endpoint: str
    remote_block_indices: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    num_tokens: int
    pushed: bool = False
    sender_id: str = ""
    traceparent: str = ""  # the request's trace context (empty: not traced)


@dataclass(frozen=True, slots=True)
class PushSpec:
    """Prefill, push mode: this step computes the whole prompt of `req_id`; push its blocks
    `block_ids` (token order), layer by layer as the forward writes them, to the decode
    instance `decode_id` whose KvTransfer rank-0 endpoint is `endpoint`, as transfer
    `transfer_id`."""

    req_id: str
    transfer_id: str
    endpoint: str
    block_ids: tuple[int, ...]
    decode_id: str = ""


@dataclass(frozen=True, slots=True)
class ReleaseSpec:
    """Decode: tell prefill at `endpoint` to free `transfer_id` without pulling (the request
    ended before its load, or needs nothing from prefill)."""

    transfer_id: str
    endpoint: str
    reason: str


@dataclass(slots=True)
class PdPlaneConnectorMetadata(KVConnectorMetadata):
    """One engine step's instructions from the scheduler side to every worker."""

    version: int = METADATA_VERSION
    seq: int = 0  # step number from the scheduler side: a worker acts on each step once
    holds: list[HoldSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    releases: list[ReleaseSpec] = field(default_factory=list)
    pushes: list[PushSpec] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.holds or self.loads or self.releases or self.pushes)
