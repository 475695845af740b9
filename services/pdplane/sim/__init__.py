"""The engine simulator: processes that behave like vLLM instances for the control plane.

See docs/sim.md. Public: `SimConfig`, `SimFleet`, `SimInstance`, and `pdplane.sim.testing`.

The three names load on first use (PEP 562): the engine model (`pdplane.sim.engine`) that the
planner's fleet simulation and the modelled autoscaling hour use needs none of the servers'
dependencies (aiohttp, prometheus-client, gRPC), so `bench/plan/autoscale_hour.py` runs where only
protobuf is installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdplane.sim.config import SimConfig
    from pdplane.sim.instance import SimInstance
    from pdplane.sim.sim_fleet import SimFleet

__all__ = ["SimConfig", "SimFleet", "SimInstance"]

_HOMES = {"SimConfig": "config", "SimFleet": "fleet", "SimInstance": "instance"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"pdplane.sim.{_HOMES[name]}"), name)
