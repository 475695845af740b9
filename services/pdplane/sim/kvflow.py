"""How a request's `kv_transfer_params` make the sim act as kv_producer or kv_consumer.

Uses `pdplane.core.kv_params`, the schema the pdplane connector and gateway share; requests
from NIXL-style routers (only `do_remote_decode` / `remote_*` fields) are accepted too.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from pdplane.core.kv_params import DecodeRequestParams, KvParamsError, PrefillRequestParams

__all__ = ["KvIntent", "classify", "producer_params"]


@dataclass(slots=True, frozen=True)
class KvIntent:
    """What the request asks of this instance's KV.

    Attributes:
        role: "producer" (prefill for a remote decode) or "consumer" (load a remote prefill).
        request_id: gateway-visible request id.
        decode: the full pdplane description on the consumer side (None for NIXL-only params).
        num_tokens: tokens to pull (consumer side; 0 = the whole prompt).
    """

    role: str
    request_id: str
    decode: DecodeRequestParams | None = None
    num_tokens: int = 0
    #: producer side: the scheduled decode's KvTransfer endpoint and id (push mode)
    push_to: str = ""
    push_engine_id: str = ""
    #: producer side: the transfer id the gateway chose ("": the sim issues one)
    transfer_id: str = ""


def classify(params: dict[str, Any] | None, header_request_id: str) -> KvIntent | None:
    """Reads `kv_transfer_params`; None when they ask for nothing.

    Raises:
        KvParamsError: consumer params that are incomplete or of the wrong protocol version.
    """
    if not params:
        return None
    if params.get("do_remote_decode") is True:
        try:
            prefill = PrefillRequestParams.from_dict(params)
        except KvParamsError:
            return KvIntent("producer", header_request_id or uuid.uuid4().hex)
        return KvIntent(
            "producer",
            prefill.request_id,
            push_to=prefill.decode_kv_endpoint or "",
            push_engine_id=prefill.decode_engine_id or "",
            transfer_id=prefill.transfer_id or "",
        )
    if params.get("do_remote_prefill") is True:
        if "pdplane_version" in params:
            decode = DecodeRequestParams.from_dict(params)
            return KvIntent("consumer", decode.request_id, decode, decode.num_tokens)
        blocks = params.get("remote_block_ids")
        if not isinstance(blocks, list) or not params.get("remote_engine_id"):
            raise KvParamsError(
                "kv_transfer_params.remote_block_ids and remote_engine_id are required"
            )
        return KvIntent("consumer", header_request_id)
    return None


def producer_params(
    *,
    request_id: str,
    transfer_id: str,
    engine_id: str,
    kv_endpoint: str,
    block_ids: list[int],
    num_tokens: int,
    kv_layout: str,
    pushed: bool = False,
) -> dict[str, Any]:
    """The `kv_transfer_params` a prefill returns: `DecodeRequestParams(...).to_dict()`."""
    return DecodeRequestParams(
        request_id=request_id,
        transfer_id=transfer_id,
        engine_id=engine_id,
        kv_endpoint=kv_endpoint,
        block_ids=block_ids,
        num_tokens=num_tokens,
        kv_layout=kv_layout,
        transport="tcp",
        tp_size=1,
        pushed=pushed,
    ).to_dict()
