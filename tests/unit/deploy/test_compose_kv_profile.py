"""Compose's scheduler predicts with the engine profile of the engines compose runs by default
(the `cpu` profile's tiny model on vLLM CPU), not a GPU's; the host's `PDPLANE_KV_PROFILE`
replaces it (a `gpu` profile's model)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from pdplane.sim.profiles import load_profile

_COMPOSE = Path(__file__).resolve().parents[3] / "deploy" / "docker-compose.yml"
_DEFAULTED = re.compile(r"^\$\{PDPLANE_KV_PROFILE:-([^}]+)\}$")


def test_every_scheduler_predicts_with_the_cpu_pair_s_profile() -> None:
    services: dict[str, Any] = yaml.safe_load(_COMPOSE.read_text())["services"]
    schedulers = [s for s in services.values() if s.get("command") == ["scheduler"]]
    assert len(schedulers) == 2  # scheduler, and scheduler-2 of the ha profile
    for scheduler in schedulers:
        match = _DEFAULTED.match(scheduler["environment"]["PDPLANE_KV_PROFILE"])
        assert match is not None and match.group(1) == "tiny-cpu"
    assert load_profile("tiny-cpu").name == "tiny-cpu"
