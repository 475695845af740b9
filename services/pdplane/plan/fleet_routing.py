"""The routing seam of `pdplane.plan.fleetsim`: a router chooses each request's legs.

`simulate_fleet(..., router=...)` calls a `FleetRouter` on its virtual clock instead of its
built-in least-outstanding-work rule; `pdplane.plan.routesim` implements it with the
scheduler's real policies and prefix index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdplane.plan.workload import RequestSpec
from pdplane.sim.engine import EngineCore, EngineRequest

__all__ = ["FleetEngines", "FleetRouter", "Routed"]


@dataclass(frozen=True, slots=True)
class FleetEngines:
    """The engines of a routed fleet, by role, in index order (a router reads their state and
    attaches its KV event sinks to `core.pool.sink`)."""

    prefill: list[EngineCore]
    decode: list[EngineCore]


@dataclass(frozen=True, slots=True)
class Routed:
    """A router's choice for one request: its token ids and its legs.

    `prefill` None: no prefill leg, the decode computes the prompt itself. `warm`: (prefill
    index, tokens): that prefill also computes the prompt's first `tokens` tokens as a request
    of its own (a prefix warm, `pdplane.scheduler.warming`).
    """

    prompt: Sequence[int]
    outputs: Sequence[int]
    prefill: int | None
    decode: int
    warm: tuple[int, int] | None = None


class FleetRouter(Protocol):
    """Chooses both legs of each request of a disaggregated `simulate_fleet` run.

    Called on the run's virtual clock (s): `start` once before the first request, `route` when
    a request arrives (None: no room now, ask again `retry_s` later, as a gateway waits for
    room), `prefill_done` when its prefill leg finished, `finished` when its decode leg did
    (returning follow-up requests, `at` on the same clock), and `tick` every `tick_s` (0:
    never) for load reports.
    """

    tick_s: float
    retry_s: float

    def start(self, engines: FleetEngines) -> None: ...

    def route(self, request: int, spec: RequestSpec, now: float) -> Routed | None: ...

    def prefill_done(self, request: int, prefill: EngineRequest, now: float) -> None: ...

    def finished(
        self, request: int, served: EngineRequest, prefill: EngineRequest | None, now: float
    ) -> Sequence[RequestSpec]: ...

    def tick(self, now: float) -> None: ...
