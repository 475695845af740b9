"""What a fleet holds per role and the moves that bring it to wanted counts.

Shared by every actuator (local processes, Kubernetes, the modelled fleet of
`pdplane.autoscale.elastic`): a controller answers wanted counts, `plan_moves` turns them into
starts and drains under the GPU budget, the actuator carries them out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ROLES", "FleetState", "Move", "RoleCount", "plan_moves"]

#: the roles an autoscaled XpYd fleet scales
ROLES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class RoleCount:
    """Instances of one role: `ready` serve (healthy and registered), `starting` hold a GPU
    but do not serve yet, `draining` take no new request and stop once idle (they still hold
    their GPU)."""

    ready: int = 0
    starting: int = 0
    draining: int = 0

    @property
    def planned(self) -> int:
        """Instances that will serve once started: ready + starting."""
        return self.ready + self.starting

    @property
    def held(self) -> int:
        """Instances holding a GPU (set of devices): ready + starting + draining."""
        return self.ready + self.starting + self.draining


@dataclass(frozen=True, slots=True)
class FleetState:
    """One model's fleet: a `RoleCount` per role, and the devices one instance holds."""

    roles: dict[str, RoleCount] = field(default_factory=dict)
    gpus_per_instance: int = 1

    def count(self, role: str) -> RoleCount:
        return self.roles.get(role, RoleCount())

    @property
    def gpus_held(self) -> int:
        return sum(c.held for c in self.roles.values()) * self.gpus_per_instance

    @property
    def label(self) -> str:
        """'2P3D' from the planned counts (+ '(1 starting, 1 draining)' when any)."""
        p, d = self.count("prefill"), self.count("decode")
        out = f"{p.planned}P{d.planned}D"
        starting = p.starting + d.starting
        draining = p.draining + d.draining
        extra = [f"{n} {what}" for n, what in ((starting, "starting"), (draining, "draining")) if n]
        return out + (f" ({', '.join(extra)})" if extra else "")


@dataclass(frozen=True, slots=True)
class Move:
    """One action: `start` one instance of `role`, or `drain` one (stop it once idle)."""

    action: str
    role: str

    def __str__(self) -> str:
        return f"{self.action} {self.role}"


def plan_moves(wanted: dict[str, int], state: FleetState, gpus: int) -> list[Move]:
    """The moves from `state` towards `wanted` planned counts per role, at most `gpus` devices
    held at any time (0 = no budget).

    Drains come first: a draining instance keeps its GPU until idle, so a move from one role
    to another (the budget full) drains now and starts the other role on a later call, once
    the GPU is free. Starts that do not fit the budget wait the same way. Raises ValueError for
    a wanted count below 1 (an XpYd fleet needs both roles).
    """
    moves: list[Move] = []
    free = (gpus - state.gpus_held) // state.gpus_per_instance if gpus else 1 << 30
    for role, n in wanted.items():
        if n < 1:
            raise ValueError(f"wanted {n} {role} instances: at least 1")
        have = state.count(role).planned
        moves += [Move("drain", role)] * max(0, have - n)
    for role, n in wanted.items():
        add = min(max(0, n - state.count(role).planned), max(0, free))
        free -= add
        moves += [Move("start", role)] * add
    return moves
