"""Validation of instance specs and load reports, shared by the registry and its clients.

Every check raises `ValidationError` whose message starts with the offending field's path
(e.g. "spec.kv_layout.block_size: must be in 1..65536, got 0"), so that the registry can answer
INVALID_ARGUMENT naming the field and a client can validate before it registers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from urllib.parse import urlsplit

from pdplane.core.grpc.echo import echo
from pdplane.core.tokenizer.bundle import valid_hash
from pdplane.v1 import instance_pb2

__all__ = [
    "KNOWN_DTYPES",
    "MAX_SPEC_BYTES",
    "ValidationError",
    "parse_host_port",
    "validate_load",
    "validate_spec",
]

#: torch dtype names a KV cache may have.
KNOWN_DTYPES = frozenset(
    {
        "float32",
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "uint8",
        "int8",
    }
)

_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_LABEL_KEY = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?")
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")
_MAX_LABELS = 64
#: Largest serialized InstanceSpec (bytes): a real one is well under 1 KiB; the per-field
#: limits alone allowed ~20 KiB, and 5,000 of those outgrew a 64 MiB snapshot message.
MAX_SPEC_BYTES = 8192
_MAX_TEXT = 256
# Upper bounds that no real deployment reaches; anything above is a bug on the caller's side.
_LIMITS = {
    "tp_size": 1024,
    "max_model_len": 1 << 24,
    "num_layers": 4096,
    "num_kv_heads": 4096,
    "head_size": 65536,
    "block_size": 65536,
}


class ValidationError(ValueError):
    """A field of a spec or load report is missing or out of range; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _check_range(field: str, value: int, limit_key: str) -> None:
    limit = _LIMITS[limit_key]
    if not 1 <= value <= limit:
        raise ValidationError(field, f"must be in 1..{limit}, got {value}")


def _check_text(field: str, value: str, required: bool = True, spaces: bool = False) -> None:
    if required and not value:
        raise ValidationError(field, "must not be empty")
    if len(value) > _MAX_TEXT:
        raise ValidationError(field, f"must be at most {_MAX_TEXT} characters")
    if not value.isprintable() or (not spaces and any(c.isspace() for c in value)):
        raise ValidationError(
            field, f"must not contain whitespace or control characters: {echo(value)}"
        )


def _check_host(field: str, host: str) -> None:
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            raise ValidationError(field, f"bad IPv6 address {echo(host)}")
        return
    if not _HOST.fullmatch(host):
        raise ValidationError(field, f"bad host {echo(host)}")


def parse_host_port(field: str, endpoint: str) -> tuple[str, int]:
    """Splits "host:port" (IPv6 as "[::1]:port") into (host, port); port in 1..65535.

    Raises ValidationError naming `field` when malformed.
    """
    host, sep, port_text = endpoint.rpartition(":")
    if not sep or not host:
        raise ValidationError(field, f"must be host:port, got {echo(endpoint)}")
    _check_host(field, host)
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValidationError(field, f"port must be in 1..65535, got {echo(port_text)}")
    return host.strip("[]"), int(port_text)


def _check_url(field: str, url: str) -> None:
    if not url:
        raise ValidationError(field, "must not be empty")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValidationError(field, f"malformed URL {echo(url)}: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ValidationError(field, f"must be an http(s):// URL, got {echo(url)}")
    if not parts.hostname or port is None:
        raise ValidationError(field, f"must name a host and a port, got {echo(url)}")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValidationError(field, f"must be a base URL without path or query, got {echo(url)}")
    if port == 0:
        raise ValidationError(field, f"port must be in 1..65535, got {echo(url)}")


def _check_layout(layout: instance_pb2.KvLayout) -> None:
    for name in ("num_layers", "num_kv_heads", "head_size", "block_size"):
        _check_range(f"spec.kv_layout.{name}", getattr(layout, name), name)
    if layout.dtype not in KNOWN_DTYPES:
        raise ValidationError(
            "spec.kv_layout.dtype",
            f"unknown dtype {echo(layout.dtype)}; one of {sorted(KNOWN_DTYPES)}",
        )


def _check_labels(labels: Mapping[str, str]) -> None:
    items = dict(labels)
    if len(items) > _MAX_LABELS:
        raise ValidationError("spec.labels", f"at most {_MAX_LABELS} labels, got {len(items)}")
    for key, value in items.items():
        if not _LABEL_KEY.fullmatch(key):
            raise ValidationError("spec.labels", f"bad label key {echo(key)}")
        if len(value) > _MAX_TEXT:
            raise ValidationError(f"spec.labels[{key}]", f"at most {_MAX_TEXT} characters")


def validate_spec(spec: instance_pb2.InstanceSpec) -> None:
    """Checks every field of an InstanceSpec; raises ValidationError naming the first bad one.

    Rules: instance_id matches [A-Za-z0-9._:-]{1,128}; role and transport are known, non-zero
    enum values; model is 1..256 printable characters; url is an http(s) base URL with host and
    port; kv_endpoint is host:port; tp_size 1..1024; max_model_len 1..2^24 tokens; kv_layout is
    set with every number in range and a known torch dtype; at most 64 labels; tokenizer_hash
    empty or "sha256:" + 64 hex digits; the whole spec at most `MAX_SPEC_BYTES` (8 KiB)
    serialized.
    """
    if not _ID.fullmatch(spec.instance_id):
        raise ValidationError(
            "spec.instance_id", f"must match [A-Za-z0-9._:-]{{1,128}}, got {echo(spec.instance_id)}"
        )
    if spec.role not in instance_pb2.Role.values() or spec.role == instance_pb2.ROLE_UNSPECIFIED:
        raise ValidationError("spec.role", f"must be PREFILL, DECODE or BOTH, got {spec.role}")
    _check_text("spec.model", spec.model)
    _check_url("spec.url", spec.url)
    parse_host_port("spec.kv_endpoint", spec.kv_endpoint)
    if (
        spec.transport not in instance_pb2.Transport.values()
        or spec.transport == instance_pb2.TRANSPORT_UNSPECIFIED
    ):
        raise ValidationError("spec.transport", f"must be TCP or NCCL, got {spec.transport}")
    _check_range("spec.tp_size", spec.tp_size, "tp_size")
    if not spec.HasField("kv_layout"):
        raise ValidationError("spec.kv_layout", "is required")
    _check_layout(spec.kv_layout)
    _check_range("spec.max_model_len", spec.max_model_len, "max_model_len")
    _check_text("spec.version", spec.version, required=False, spaces=True)
    _check_labels(spec.labels)
    if spec.tokenizer_hash and not valid_hash(spec.tokenizer_hash):
        raise ValidationError(
            "spec.tokenizer_hash",
            f'must be "" or "sha256:" + 64 hex digits, got {echo(spec.tokenizer_hash)}',
        )
    size = spec.ByteSize()
    if size > MAX_SPEC_BYTES:
        raise ValidationError("spec", f"at most {MAX_SPEC_BYTES} bytes serialized, got {size}")


def validate_load(load: instance_pb2.LoadReport) -> None:
    """Checks a LoadReport: kv_cache_usage finite in 0..1, free_kv_blocks <= total_kv_blocks
    (when the total is known). Raises ValidationError naming the field ("load.<name>").
    """
    usage = load.kv_cache_usage
    if not math.isfinite(usage) or not 0.0 <= usage <= 1.0:
        raise ValidationError("load.kv_cache_usage", f"must be in 0..1, got {usage}")
    if load.total_kv_blocks and load.free_kv_blocks > load.total_kv_blocks:
        raise ValidationError(
            "load.free_kv_blocks",
            f"{load.free_kv_blocks} exceeds total_kv_blocks {load.total_kv_blocks}",
        )
