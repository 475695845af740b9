"""The local actuator: starts and stops the engine instances of a `pdplane up` fleet.

- `start(role)` launches one more instance (vLLM CPU or `pdplane sim`, as the fleet runs) on
  free ports; it counts as starting until it answers /health and the registry lists it, then
  as ready.
- `drain(role)` stops one instance without losing a request: an instance still starting is
  stopped at once; otherwise the least loaded ready one is marked DRAINING in the registry
  (`pdplane drain`'s call, admin token: the schedulers stop picking it), and once the
  registry's load report shows it without running or waiting requests and KV transfers, twice
  in a row and at least `settle_s` after the drain (requests scheduled just before still
  arrive), its process is stopped (it deregisters). A decode that cannot finish in
  `drain_timeout_s` is stopped anyway and reported.

`_idle` is the one place that decides an instance may go: request migration (continuing a
decode's streams on another decode) would replace that wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdplane.autoscale.scrape import role_of
from pdplane.autoscale.state import ROLES, FleetState, RoleCount
from pdplane.cli.drain import drain_instance
from pdplane.core.grpc import util as grpc_util
from pdplane.launch.deployment import Engine, Fleet
from pdplane.launch.vllm_cpu import KvRole
from pdplane.registry.failover import RegistryEndpoints
from pdplane.v1 import instance_pb2

__all__ = ["LocalActuator"]

_KV_ROLE: dict[str, KvRole] = {"prefill": "kv_producer", "decode": "kv_consumer"}


@dataclass
class _Draining:
    role: str
    since: float
    idle_reads: int = 0


class LocalActuator:
    """Carries out moves on `fleet` (see the module docstring); `refresh` with each registry
    list before `state`."""

    def __init__(
        self,
        fleet: Fleet,
        *,
        say: Callable[[str], None] = lambda _m: None,
        settle_s: float = 2.0,
        drain_timeout_s: float = 600.0,
    ) -> None:
        self.fleet = fleet
        self.say = say
        self.settle_s = settle_s
        self.drain_timeout_s = drain_timeout_s
        self.starting: dict[Engine, str] = {}
        self.draining: dict[Engine, _Draining] = {}
        self.listed: dict[str, instance_pb2.Instance] = {}
        self._endpoints = RegistryEndpoints(fleet.registry_address)
        self._admin = grpc_util.token_metadata(fleet.spec.admin_token)

    def refresh(self, instances: Sequence[instance_pb2.Instance]) -> None:
        """Takes the registry's list: starting instances that serve become ready, drained
        ones that are idle are stopped."""
        self.listed = {i.spec.instance_id: i for i in instances}
        now = time.monotonic()
        for inst, role in list(self.starting.items()):
            name = self.fleet.name_of(inst)
            if name in self.listed and self.fleet.instance_ready(inst):
                del self.starting[inst]
                self.say(f"{name} ({role}) healthy and registered: serving")
        for inst, d in list(self.draining.items()):
            name = self.fleet.name_of(inst)
            listed = self.listed.get(name)
            d.idle_reads = d.idle_reads + 1 if _idle(listed) else 0
            waited = now - d.since
            if (d.idle_reads >= 2 and waited >= self.settle_s) or waited >= self.drain_timeout_s:
                note = "idle" if d.idle_reads >= 2 else "NOT idle, drain timeout"
                del self.draining[inst]
                self.fleet.remove_instance(inst)
                self.say(f"{name} ({d.role}) drained ({note}) after {waited:.1f} s: stopped")

    def state(self) -> FleetState:
        """Ready = listed SERVING instances the actuator is not starting or draining."""
        counts = {role: [0, 0, 0] for role in ROLES}
        busy = {self.fleet.name_of(i) for i in (*self.starting, *self.draining)}
        for name, inst in self.listed.items():
            role = role_of(inst)
            if (
                role in counts
                and name not in busy
                and inst.state == instance_pb2.INSTANCE_STATE_SERVING
            ):
                counts[role][0] += 1
        for role in self.starting.values():
            counts[role][1] += 1
        for d in self.draining.values():
            counts[d.role][2] += 1
        return FleetState({r: RoleCount(*c) for r, c in counts.items()})

    def start(self, role: str) -> None:
        """Launches one `role` instance (returns at once)."""
        inst = self.fleet.launch_instance(_KV_ROLE[role])
        self.starting[inst] = role

    def drain(self, role: str) -> None:
        """Drains one `role` instance (see the module docstring). Raises grpc.RpcError when
        the registry refuses the drain."""
        early = [i for i, r in self.starting.items() if r == role]
        if early:
            inst = early[-1]
            del self.starting[inst]
            name = self.fleet.name_of(inst)
            self.fleet.remove_instance(inst)
            self.say(f"{name} ({role}) stopped before it served")
            return
        candidates = []
        for engine in self.fleet.instances:
            listed = self.listed.get(self.fleet.name_of(engine))
            if (
                engine in self.starting
                or engine in self.draining
                or listed is None
                or role_of(listed) != role
                or listed.state != instance_pb2.INSTANCE_STATE_SERVING
            ):
                continue
            candidates.append((listed.load.num_running + listed.load.num_waiting, engine))
        if len(candidates) <= 1:
            return  # never the last one serving
        _, chosen = min(candidates, key=lambda c: c[0])
        name = self.fleet.name_of(chosen)
        drain_instance(self._endpoints, name, self._admin)
        self.draining[chosen] = _Draining(role, time.monotonic())
        self.say(f"{name} ({role}) draining: no new requests, stops once idle")

    def close(self) -> None:
        self._endpoints.close()


def _idle(listed: instance_pb2.Instance | None) -> bool:
    """Nothing left on the instance: gone from the registry, or its load report shows no
    running or waiting request and no KV transfer in flight."""
    if listed is None:
        return True
    load = listed.load
    return load.num_running == 0 and load.num_waiting == 0 and load.inflight_transfers == 0
