"""One control step on a running fleet: read it, decide, act, log and export.

`Autoscaler.step()` (called every `interval_s` by `pdplane up --autoscale` and `pdplane
autoscale`): the registry's list -> the actuator's view of starting / draining instances ->
the window's observation -> the controller's decision -> `plan_moves` under the GPU budget ->
the actuator's starts and drains. Only the leader acts (`pdplane.autoscale.leader`); every
replica observes, so a new leader decides on a full window.

Prometheus gauges (`AutoscaleMetrics`, on the caller's registry):
`pdplane_autoscale_instances{role,state}` (ready, starting, draining),
`pdplane_autoscale_wanted_instances{role}`, `pdplane_autoscale_moves_total{role,action}`,
`pdplane_autoscale_traffic{quantity}` (rate_rps, prompt_tokens, output_tokens),
`pdplane_autoscale_predicted_ttft_p90_seconds{fleet}`,
`pdplane_autoscale_predicted_itl_p90_seconds{fleet}`,
`pdplane_autoscale_predicted_goodput_rps{fleet}` (fleet = before | after, of the last move),
`pdplane_autoscale_leader` (1 on the replica that acts),
`pdplane_autoscale_spend_credit_gpu_seconds` (with a spend target: what time below it earned
and time above it has not spent yet, `pdplane.autoscale.spend`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdplane.autoscale.controller import Controller, Decision
from pdplane.autoscale.observe import Observation
from pdplane.autoscale.scrape import FleetScraper
from pdplane.autoscale.state import ROLES, FleetState, Move, plan_moves
from pdplane.v1 import instance_pb2

__all__ = ["Actuator", "AutoscaleMetrics", "Autoscaler"]


class Actuator(Protocol):
    """Carries out moves on one model's fleet (local processes, Kubernetes workloads)."""

    def refresh(self, instances: list[instance_pb2.Instance]) -> None:
        """Takes the registry's current list (instances of the model)."""

    def state(self) -> FleetState:
        """Ready, starting and draining instances per role."""
        ...

    def start(self, role: str) -> None:
        """Starts one instance of `role`; it counts as ready once healthy and registered."""

    def drain(self, role: str) -> None:
        """Stops one instance of `role` without losing a request (drain, wait, stop)."""


class AutoscaleMetrics:
    """The controller's gauges (see the module docstring)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.instances = Gauge(
            "pdplane_autoscale_instances",
            "Instances per role and state (ready, starting, draining)",
            ["role", "state"],
            registry=r,
        )
        self.wanted = Gauge(
            "pdplane_autoscale_wanted_instances",
            "Instances per role the controller wants (ready + starting)",
            ["role"],
            registry=r,
        )
        self.moves = Counter(
            "pdplane_autoscale_moves",
            "Moves made, by role and action",
            ["role", "action"],
            registry=r,
        )
        self.traffic = Gauge(
            "pdplane_autoscale_traffic",
            "Measured traffic over the window: rate_rps (req/s), prompt_tokens and "
            "output_tokens (mean per request)",
            ["quantity"],
            registry=r,
        )
        self.ttft = Gauge(
            "pdplane_autoscale_predicted_ttft_p90_seconds",
            "Simulated TTFT p90 of the fleet before and after the last move",
            ["fleet"],
            registry=r,
        )
        self.itl = Gauge(
            "pdplane_autoscale_predicted_itl_p90_seconds",
            "Simulated ITL p90 of the fleet before and after the last move",
            ["fleet"],
            registry=r,
        )
        self.goodput = Gauge(
            "pdplane_autoscale_predicted_goodput_rps",
            "Simulated goodput of the fleet before and after the last move",
            ["fleet"],
            registry=r,
        )
        self.leader = Gauge(
            "pdplane_autoscale_leader", "1 on the controller replica that acts", registry=r
        )
        self.credit = Gauge(
            "pdplane_autoscale_spend_credit_gpu_seconds",
            "GPU-seconds the spend target (--mean-gpus) allows beyond what was held over its "
            "window: earned below the target, spent above it",
            registry=r,
        )

    def update(
        self,
        obs: Observation,
        state: FleetState,
        decision: Decision | None,
        leader: bool,
        credit: float | None = None,
    ) -> None:
        """Sets the gauges from one step (`credit`: the spend account's, None without one)."""
        if credit is not None:
            self.credit.set(credit)
        t = obs.traffic
        for name, value in (
            ("rate_rps", t.rate),
            ("prompt_tokens", t.isl),
            ("output_tokens", t.osl),
        ):
            self.traffic.labels(name).set(value)
        for role in ROLES:
            c = state.count(role)
            for what, n in (("ready", c.ready), ("starting", c.starting), ("draining", c.draining)):
                self.instances.labels(role, what).set(n)
            if decision is not None:
                wanted = decision.wanted or decision.current
                self.wanted.labels(role).set(wanted[role])
        self.leader.set(float(leader))
        if decision is None or decision.before is None or decision.after is None:
            return
        for fleet, r in (("before", decision.before), ("after", decision.after)):
            self.ttft.labels(fleet).set(r.ttft_q(0.9))
            self.itl.labels(fleet).set(r.itl_q(0.9))
            self.goodput.labels(fleet).set(r.goodput)


class Autoscaler:
    """Reads, decides and acts for one model's fleet (see the module docstring)."""

    def __init__(
        self,
        controller: Controller,
        scraper: FleetScraper,
        actuator: Actuator,
        *,
        metrics: AutoscaleMetrics | None = None,
        is_leader: Callable[[], bool] = lambda: True,
        say: Callable[[str], None] = lambda _m: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.controller = controller
        self.scraper = scraper
        self.actuator = actuator
        self.metrics = metrics or AutoscaleMetrics()
        self.is_leader = is_leader
        self.say = say
        self.clock = clock
        self.moves: list[tuple[float, Move]] = []

    def step(self) -> Decision | None:
        """One step; returns the decision (None when this replica is not the leader).
        Raises grpc.RpcError when the registry cannot be read."""
        now = self.clock()
        listed = self.scraper.list_instances()
        self.actuator.refresh(listed)
        obs = self.scraper.observe(listed, now)
        gpi = self.controller.bounds.gpus_per_instance
        state = replace(self.actuator.state(), gpus_per_instance=gpi)
        leader = self.is_leader()
        decision = self.controller.decide(obs, state, now) if leader else None
        if decision is not None and decision.wanted:
            moves = plan_moves(decision.wanted, state, self.controller.bounds.gpus)
            # A start that does not fit the GPU budget waits for a draining instance's GPU.
            done = ", ".join(map(str, moves)) or "none yet (waiting for draining instances' GPUs)"
            self.say(f"{decision.describe()}; moves: {done}")
            for move in moves:
                if move.action == "start":
                    self.actuator.start(move.role)
                else:
                    self.actuator.drain(move.role)
                self.metrics.moves.labels(move.role, move.action).inc()
                self.moves.append((now, move))
            state = replace(self.actuator.state(), gpus_per_instance=gpi)
        spend = self.controller.spend
        credit = spend.account.credit(now) if spend is not None else None
        self.metrics.update(obs, state, decision, leader, credit)
        return decision
