"""The connector against the installed vLLM's `KVConnectorBase_V1`: nothing abstract left,
the same parameter names as the base (vLLM calls some hooks by keyword), and sleep mode
refused (vLLM >= 0.33 asks the connector class at startup)."""

from __future__ import annotations

import inspect

import pytest

base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

from pdplane.connector.facade import PdPlaneConnector  # noqa: E402


def test_every_abstract_method_is_implemented() -> None:
    abstract = set(base.KVConnectorBase_V1.__abstractmethods__)
    assert abstract, "the base class lists abstract methods"
    assert not PdPlaneConnector.__abstractmethods__
    for name in abstract:
        assert name in vars(PdPlaneConnector), f"{name} is inherited, not implemented"


def test_overridden_hooks_take_the_base_parameter_names() -> None:
    overridden = [
        name
        for name, member in vars(PdPlaneConnector).items()
        if callable(member) and not name.startswith("_") and hasattr(base.KVConnectorBase_V1, name)
    ]
    assert "get_num_new_matched_tokens" in overridden
    for name in overridden:
        ours = list(inspect.signature(getattr(PdPlaneConnector, name)).parameters)
        theirs = list(inspect.signature(getattr(base.KVConnectorBase_V1, name)).parameters)
        assert ours[: len(theirs)] == theirs, f"{name}: {ours} vs base {theirs}"


def test_sleep_mode_is_refused() -> None:
    assert PdPlaneConnector.supports_sleep_mode(None) is False
