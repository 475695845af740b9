"""The engine simulator: processes that behave like vLLM instances for the control plane.

See docs/sim.md. Public: `SimConfig`, `SimInstance`, `SimFleet`, and `pdplane.sim.testing`.
"""

from __future__ import annotations

from pdplane.sim.config import SimConfig
from pdplane.sim.fleet import SimFleet
from pdplane.sim.instance import SimInstance

__all__ = ["SimConfig", "SimFleet", "SimInstance"]
