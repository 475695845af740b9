"""Plain-JSON views of registry messages (for `pdplane ls --json`).

Keys are stable snake_case names and enums are lower-case words ("prefill", "serving"), so
scripts do not depend on protobuf's JSON mapping.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from pdplane.core.instance.layout import fingerprint
from pdplane.v1 import instance_pb2, registry_pb2

__all__ = ["enum_word", "event_to_dict", "instance_to_dict", "load_to_dict", "parse_role"]

_ENUM_PREFIXES = ("ROLE_", "TRANSPORT_", "INSTANCE_STATE_")


def enum_word(name: str) -> str:
    """ "ROLE_PREFILL" -> "prefill", "INSTANCE_STATE_DRAINING" -> "draining"."""
    for prefix in _ENUM_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :].lower()
    return name.lower()


def parse_role(word: str) -> instance_pb2.Role.ValueType:
    """ "prefill" / "decode" / "both" (any case) -> Role; raises ValueError otherwise."""
    try:
        return instance_pb2.Role.Value(f"ROLE_{word.upper()}")
    except ValueError:
        raise ValueError(f"unknown role {word!r}; one of prefill, decode, both") from None


def _time(ts: Timestamp) -> str | None:
    if not ts.seconds and not ts.nanos:
        return None
    return ts.ToDatetime().isoformat(timespec="milliseconds") + "Z"


def load_to_dict(load: instance_pb2.LoadReport) -> dict[str, Any]:
    """Every LoadReport field by its proto name (counts, kv_cache_usage 0..1, bytes)."""
    return {field.name: getattr(load, field.name) for field in load.DESCRIPTOR.fields}


def instance_to_dict(instance: instance_pb2.Instance) -> dict[str, Any]:
    """An Instance as a JSON-ready dict: id, role, model, url, kv_endpoint, state, load, ..."""
    spec = instance.spec
    return {
        "id": spec.instance_id,
        "role": enum_word(instance_pb2.Role.Name(spec.role)),
        "model": spec.model,
        "url": spec.url,
        "kv_endpoint": spec.kv_endpoint,
        "transport": enum_word(instance_pb2.Transport.Name(spec.transport)),
        "tp_size": spec.tp_size,
        "kv_layout": fingerprint(spec.kv_layout),
        "max_model_len": spec.max_model_len,
        "version": spec.version,
        "labels": dict(spec.labels),
        "tokenizer_hash": spec.tokenizer_hash,
        "state": enum_word(instance_pb2.InstanceState.Name(instance.state)),
        "load": load_to_dict(instance.load),
        "lease_id": instance.lease_id,
        "registered_at": _time(instance.registered_at),
        "last_heartbeat": _time(instance.last_heartbeat),
        "revision": instance.revision,
    }


def event_to_dict(event: registry_pb2.WatchEvent) -> dict[str, Any]:
    """A WatchEvent as a dict: type, revision, then `instances` (SNAPSHOT), `events` (BATCH)
    or `instance`."""
    out: dict[str, Any] = {
        "type": registry_pb2.WatchEvent.Type.Name(event.type),
        "revision": event.revision,
    }
    if event.type == registry_pb2.WatchEvent.SNAPSHOT:
        out["instances"] = [instance_to_dict(i) for i in event.instances]
    elif event.type == registry_pb2.WatchEvent.BATCH:
        out["events"] = [event_to_dict(e) for e in event.events]
    else:
        out["instance"] = instance_to_dict(event.instance)
    if event.reason:
        out["reason"] = event.reason
    return out
