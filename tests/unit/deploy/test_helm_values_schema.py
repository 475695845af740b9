"""deploy/helm/pdplane/values.schema.json: a bad value fails `helm template` / `helm lint` with
a message naming the key (Helm validates the merged values against the chart's schema before
it renders anything), and every preset and documented variant still passes."""

from __future__ import annotations

import json
import re
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml

from tests.unit.deploy.helm_chart import CHART_DIR, PRESETS, lint, preset, render

SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text())

# (values, the JSON pointer Helm names in its message)
BAD_VALUES: dict[str, tuple[dict[str, Any], str]] = {
    "string-for-number": ({"registry": {"port": "fifty"}}, "/registry/port"),
    "negative-replicas": ({"gateway": {"replicas": -1}}, "/gateway/replicas"),
    "negative-engine-replicas": (
        {"engines": [{"name": "p", "role": "prefill", "replicas": -2}]},
        "/engines/0/replicas",
    ),
    "unknown-role": ({"engines": [{"name": "x", "role": "router"}]}, "/engines/0/role"),
    "typo-top-level-key": ({"gatway": {"replicas": 2}}, "gatway"),
    "typo-nested-key": ({"scheduler": {"prefilPolicy": "random"}}, "prefilPolicy"),
    "typo-engine-key": (
        {"engines": [{"name": "d", "role": "decode", "tensorParalelSize": 2}]},
        "tensorParalelSize",
    ),
    "port-out-of-range": ({"scheduler": {"port": 70000}}, "/scheduler/port"),
    "engine-port-zero": ({"engineDefaults": {"kvPort": 0}}, "/engineDefaults/kvPort"),
    "unknown-policy": ({"scheduler": {"decodePolicy": "fastest"}}, "/scheduler/decodePolicy"),
    "engine-without-role": ({"engines": [{"name": "p"}]}, "/engines/0"),
    "empty-kv-profile": ({"scheduler": {"kvProfile": ""}}, "/scheduler/kvProfile"),
}


def test_the_schema_is_draft_07() -> None:
    assert SCHEMA["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(SCHEMA)


def test_values_yaml_and_every_preset_match_the_schema() -> None:
    defaults = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    jsonschema.Draft7Validator(SCHEMA).validate(defaults)
    for name in PRESETS:
        jsonschema.Draft7Validator(SCHEMA).validate(preset(name))


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_renders_with_the_schema(name: str) -> None:
    assert render(preset(name))


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_a_bad_value_fails_the_render_naming_the_key(case: str) -> None:
    values, key = BAD_VALUES[case]
    with pytest.raises(helm.HelmValuesError, match=re.escape(key)):
        render(preset("cpu-demo"), values)


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_a_bad_value_fails_helm_lint_naming_the_key(case: str) -> None:
    values, key = BAD_VALUES[case]
    errors = [m["error"] for m in lint({**preset("cpu-demo"), **values}) if m["severity"] >= 3]
    assert any(key in e for e in errors), errors
