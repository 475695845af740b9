"""Every validation rule of an InstanceSpec / LoadReport names the offending field."""

from __future__ import annotations

import math
from typing import Any

import pytest

from pdplane.core.instance.validation import (
    ValidationError,
    parse_host_port,
    validate_load,
    validate_spec,
)
from pdplane.v1 import instance_pb2
from tests.integration.registry.fixtures import make_spec
from tests.unit.registry.bad_specs import BAD_SPECS


@pytest.mark.parametrize(("field", "overrides"), BAD_SPECS)
def test_bad_spec_names_the_field(field: str, overrides: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as info:
        validate_spec(make_spec(**overrides))
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_missing_layout_is_named() -> None:
    spec = make_spec()
    spec.ClearField("kv_layout")
    with pytest.raises(ValidationError, match=r"^spec\.kv_layout: is required"):
        validate_spec(spec)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"role": instance_pb2.ROLE_BOTH, "transport": instance_pb2.TRANSPORT_NCCL},
        {"url": "https://[::1]:8443", "kv_endpoint": "[::1]:50100"},
        {"url": "http://vllm-p0.local:8100/", "kv_endpoint": "vllm-p0.local:50100"},
        {"labels": {"zone": "a", "pdplane.io/pool": "gold"}, "version": "vllm 0.32.0"},
        {"instance_id": "node-1:prefill.0_a"},
    ],
)
def test_good_specs_pass(overrides: dict[str, Any]) -> None:
    validate_spec(make_spec(**overrides))


@pytest.mark.parametrize(
    ("load", "field"),
    [
        (instance_pb2.LoadReport(kv_cache_usage=1.5), "load.kv_cache_usage"),
        (instance_pb2.LoadReport(kv_cache_usage=-0.1), "load.kv_cache_usage"),
        (instance_pb2.LoadReport(kv_cache_usage=math.nan), "load.kv_cache_usage"),
        (instance_pb2.LoadReport(free_kv_blocks=11, total_kv_blocks=10), "load.free_kv_blocks"),
    ],
)
def test_bad_load_names_the_field(load: instance_pb2.LoadReport, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        validate_load(load)
    assert info.value.field == field


def test_good_load_passes() -> None:
    validate_load(instance_pb2.LoadReport(kv_cache_usage=1.0, free_kv_blocks=0, total_kv_blocks=8))


def test_parse_host_port() -> None:
    assert parse_host_port("f", "127.0.0.1:80") == ("127.0.0.1", 80)
    assert parse_host_port("f", "[::1]:50100") == ("::1", 50100)
    with pytest.raises(ValidationError, match=r"^f: "):
        parse_host_port("f", ":80")
