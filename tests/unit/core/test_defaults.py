"""The default ports: below the kernel's ephemeral range, and the same in every deployment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pdplane.core import defaults
from pdplane.launch.ports import ephemeral_floor

_ROOT = Path(__file__).resolve().parents[3]
#: `pdplane up --prefill 16 --decode 16`, the most instances it starts.
_MOST_INSTANCES = 32


def _default_ports() -> dict[str, range]:
    return {
        "gateway": range(defaults.GATEWAY_PORT, defaults.GATEWAY_PORT + 1),
        "registry": range(defaults.REGISTRY_PORT, defaults.REGISTRY_PORT + 1),
        "scheduler": range(defaults.SCHEDULER_PORT, defaults.SCHEDULER_PORT + 1),
        "scheduler metrics": range(
            defaults.SCHEDULER_METRICS_PORT, defaults.SCHEDULER_METRICS_PORT + 1
        ),
        "vLLM": range(defaults.VLLM_BASE_PORT, defaults.VLLM_BASE_PORT + _MOST_INSTANCES),
        "KvTransfer": range(defaults.KV_BASE_PORT, defaults.KV_BASE_PORT + _MOST_INSTANCES),
    }


def test_default_ports_lie_below_every_ephemeral_range() -> None:
    # Linux's default range starts at 32768 (IANA's, used by other systems, at 49152): ports
    # above may be handed to any outgoing connection or port-0 socket, vLLM's ZMQ ones too.
    floor = min(32768, ephemeral_floor())
    for name, ports in _default_ports().items():
        assert ports[-1] < floor, f"{name} ports {ports} reach the ephemeral range"


def test_default_port_runs_do_not_overlap() -> None:
    seen: dict[int, str] = {}
    for name, ports in _default_ports().items():
        for port in ports:
            assert port not in seen, f"{name} port {port} is also a {seen[port]} port"
            seen[port] = name


def _yaml(path: str) -> Any:
    return yaml.safe_load((_ROOT / path).read_text())


def test_the_chart_and_compose_use_the_default_ports() -> None:
    values = _yaml("deploy/helm/pdplane/values.yaml")
    assert values["registry"]["port"] == defaults.REGISTRY_PORT
    assert values["scheduler"]["port"] == defaults.SCHEDULER_PORT
    assert values["gateway"]["port"] == defaults.GATEWAY_PORT
    assert values["engineDefaults"]["port"] == defaults.VLLM_BASE_PORT
    assert values["engineDefaults"]["kvPort"] == defaults.KV_BASE_PORT
    services = _yaml("deploy/docker-compose.yml")["services"]
    assert services["registry"]["environment"]["PDPLANE_PORT"] == str(defaults.REGISTRY_PORT)
    assert services["scheduler"]["environment"]["PDPLANE_PORT"] == str(defaults.SCHEDULER_PORT)
    assert services["gateway"]["environment"]["PDPLANE_PORT"] == str(defaults.GATEWAY_PORT)
