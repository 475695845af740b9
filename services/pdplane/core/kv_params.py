"""The `kv_transfer_params` protocol between the gateway, the prefill and the decode instance.

vLLM carries a request's `kv_transfer_params` (a JSON object) into the KV connector and returns
the connector's `request_finished` dict as `kv_transfer_params` in the non-streaming response.
pdplane uses that channel, and nothing else, to coordinate a transfer:

1. gateway -> prefill: `PrefillRequestParams` (`do_remote_decode: true` + the gateway's request id
   and the transfer id prefill is to hold the KV under, so that the gateway can free it even
   when it never reads prefill's answer).
2. prefill -> gateway (in its response): `DecodeRequestParams`: where and what to pull.
3. gateway -> decode: those parameters unchanged, on the client's original request.

Field names follow vLLM's NixlConnector where the meaning is the same (`do_remote_decode`,
`do_remote_prefill`, `remote_engine_id`, `remote_block_ids`, `remote_host`, `remote_port`), so
routers written for NIXL (e.g. vllm-router's P/D mode) can drive pdplane instances; pdplane's own
fields are prefixed `pdplane_`. Values are JSON-only (they cross vLLM's process boundary
serialised).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import sys
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "PROTOCOL_VERSION",
    "DecodeRequestParams",
    "KvParamsError",
    "PrefillRequestParams",
    "make_transfer_id",
    "prompt_fingerprint",
]

#: Bumped on any incompatible change of the fields below.
PROTOCOL_VERSION = 1


#: A transfer id as `make_transfer_id` writes it (characters safe in logs, bounded length).
_TRANSFER_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]")
_MAX_KEY_LEN = 96


class KvParamsError(ValueError):
    """Raised when `kv_transfer_params` are missing a field or hold a value of the wrong type."""


def make_transfer_id(gateway_request_id: str) -> str:
    """`<gateway request id>.<16 hex>`: traceable to the gateway's id, unguessable.

    The id part keeps at most 96 characters of [A-Za-z0-9_.:-] (others become "_"), so a
    client-chosen request id can neither forge log lines nor grow without bound."""
    safe = _UNSAFE.sub("_", gateway_request_id[:_MAX_KEY_LEN]) or "req"
    return f"{safe}.{secrets.token_hex(8)}"


def _require(d: dict[str, Any], key: str, typ: type | tuple[type, ...]) -> Any:
    if key not in d:
        raise KvParamsError(f"kv_transfer_params.{key} is missing")
    value = d[key]
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise KvParamsError(f"kv_transfer_params.{key} has type {type(value).__name__}")
    return value


@dataclass(frozen=True, slots=True)
class PrefillRequestParams:
    """What the gateway puts on the prefill leg: keep the KV for a remote decode.

    `request_id` is the gateway-visible request id (X-Request-Id); the connector derives its
    transfer id from it (never from vLLM's internal, randomised request id) unless the gateway
    chose the transfer id itself (`transfer_id`).
    """

    request_id: str
    #: Optional (push mode): the scheduled decode instance's registry id and the host:port of
    #: its KvTransfer server, where prefill may push the KV during its forward. Absent = pull.
    decode_engine_id: str | None = None
    decode_kv_endpoint: str | None = None
    #: Optional: the transfer id prefill holds the KV under (`make_transfer_id`'s form). The
    #: gateway chooses it so that it can free the KV by `AbortTransfer` when it gives up on
    #: prefill's answer (its client left, its time ran out): prefill may have finished and
    #: hold the KV under this id although the gateway never read the answer. Absent: prefill
    #: issues one (and returns it, as always).
    transfer_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
            "pdplane_version": PROTOCOL_VERSION,
            "pdplane_request_id": self.request_id,
        }
        if self.decode_kv_endpoint:
            d["pdplane_decode_engine_id"] = self.decode_engine_id or ""
            d["pdplane_decode_kv_endpoint"] = self.decode_kv_endpoint
        if self.transfer_id:
            d["pdplane_transfer_id"] = self.transfer_id
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrefillRequestParams:
        """Raises KvParamsError unless `d` asks for a remote decode with a request id (the
        optional decode fields, when present, must be strings; a transfer id, 1-128 characters
        of [A-Za-z0-9_.:-])."""
        if d.get("do_remote_decode") is not True:
            raise KvParamsError("kv_transfer_params.do_remote_decode is not true")
        optional = {}
        for key in ("decode_engine_id", "decode_kv_endpoint", "transfer_id"):
            if d.get(f"pdplane_{key}") is not None:
                optional[key] = _require(d, f"pdplane_{key}", str) or None
        transfer_id = optional.get("transfer_id")
        if transfer_id is not None and not _TRANSFER_ID.fullmatch(transfer_id):
            raise KvParamsError(
                "kv_transfer_params.pdplane_transfer_id must be 1-128 characters of [A-Za-z0-9_.:-]"
            )
        return cls(request_id=_require(d, "pdplane_request_id", str), **optional)


@dataclass(frozen=True, slots=True)
class DecodeRequestParams:
    """What prefill returns and the decode leg carries: where and what to pull.

    Attributes:
        request_id: gateway-visible request id (same as in PrefillRequestParams).
        transfer_id: issued by prefill; the only key that grants a pull of its blocks.
        engine_id: prefill's registry instance id.
        kv_endpoint: host:port of prefill's KvTransfer gRPC server.
        block_ids: prefill's KV cache block ids holding the prompt, in token order.
        num_tokens: prompt tokens whose KV prefill computed (tokens).
        kv_layout: layout fingerprint (`pdplane.core.instance.layout.fingerprint`); decode refuses a
            mismatch.
        transport: "tcp" or "nccl".
        tp_size: prefill's tensor-parallel size.
        pushed: optional (push mode): prefill started pushing this transfer's KV into
            decode's receive buffer; decode takes it from there, else pulls as usual.
        prompt_hash: optional `prompt_fingerprint` of the prompt prefill computed; decode
            refuses the KV (computes locally) when its own prompt's fingerprint differs, so a
            mix-up can never decode one prompt with another's KV cache.
        traceparent: optional W3C trace context the gateway adds for the decode leg, so the
            connector's transfer spans join the request's trace (`pdplane.core.tracing`).
    """

    request_id: str
    transfer_id: str
    engine_id: str
    kv_endpoint: str
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    kv_layout: str = ""
    transport: str = "tcp"
    tp_size: int = 1
    pushed: bool = False
    prompt_hash: str = ""
    traceparent: str = ""

    def to_dict(self) -> dict[str, Any]:
        host, _, port = self.kv_endpoint.rpartition(":")
        d = asdict(self)
        # Absent unless set (older decoders ignore them).
        for optional in ("pushed", "prompt_hash", "traceparent"):
            if not d[optional]:
                del d[optional]
        return {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": list(self.block_ids),
            "remote_host": host,
            "remote_port": int(port) if port.isdigit() else None,
            "pdplane_version": PROTOCOL_VERSION,
            **{f"pdplane_{k}": v for k, v in d.items() if k not in ("engine_id", "block_ids")},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DecodeRequestParams:
        """Raises KvParamsError unless `d` is a complete remote-prefill description."""
        if d.get("do_remote_prefill") is not True:
            raise KvParamsError("kv_transfer_params.do_remote_prefill is not true")
        version = _require(d, "pdplane_version", int)
        if version != PROTOCOL_VERSION:
            raise KvParamsError(
                f"kv_transfer_params.pdplane_version {version} != {PROTOCOL_VERSION}"
            )
        block_ids = _require(d, "remote_block_ids", list)
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in block_ids):
            raise KvParamsError("kv_transfer_params.remote_block_ids must be integers")
        return cls(
            request_id=_require(d, "pdplane_request_id", str),
            transfer_id=_require(d, "pdplane_transfer_id", str),
            engine_id=_require(d, "remote_engine_id", str),
            kv_endpoint=_require(d, "pdplane_kv_endpoint", str),
            block_ids=list(block_ids),
            num_tokens=_require(d, "pdplane_num_tokens", int),
            kv_layout=_require(d, "pdplane_kv_layout", str),
            transport=_require(d, "pdplane_transport", str),
            tp_size=_require(d, "pdplane_tp_size", int),
            pushed=_require(d, "pdplane_pushed", bool) if "pdplane_pushed" in d else False,
            prompt_hash=_require(d, "pdplane_prompt_hash", str)
            if "pdplane_prompt_hash" in d
            else "",
            traceparent=_require(d, "pdplane_traceparent", str)
            if "pdplane_traceparent" in d
            else "",
        )


def prompt_fingerprint(token_ids: Sequence[int]) -> str:
    """A 64-bit BLAKE2b digest (16 hex characters) of a prompt's token ids.

    Ids are hashed as little-endian signed 64-bit integers, so prefill and decode agree on any
    platform. Cost: ~1 us per 1,000 tokens.
    """
    ids = array("q", token_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    return hashlib.blake2b(ids.tobytes(), digest_size=8).hexdigest()
