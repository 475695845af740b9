"""An XpYd fleet that changes while it serves, in modelled time (no wall clock).

`pdplane.plan.fleetsim`'s event loop (the same engine model, routing and KV pulls) plus what
a real move costs:

- scale-out: an instance holds its GPU from its start and takes requests only once healthy,
  `startup_s` later (vLLM loads the weights and warms up first);
- scale-in is drain-and-wait, what `pdplane drain` and the Helm chart's preStop hook do: the
  instance takes no new request, finishes what it runs (a prefill also keeps the KV blocks that
  decodes still pull), then stops, holding its GPU until then. An instance still starting
  stops at once. No request is lost; what its prefix cache held is (these workloads share no
  prefix between requests, so that costs nothing here);
- requests are routed when they arrive, among the instances that take requests;
- with `inflight_budget` > 0, the gateway's flow control in front (docs/flow-control.md, one
  tenant and priority): the tokens (prompt + output) of the requests sent and not finished
  stay within `inflight_budget` x the serving decodes' KV cache (tokens); a request past it
  waits at the gateway in arrival order, is shed at once (429) when its projected wait (the
  tokens waiting ahead of it, its own included, / the tokens per second that finished over
  the last `drain_window_s`) is past `queue_timeout_s`, and leaves (429 or 503) when its wait
  reaches it. A shed or timed-out request gets no token and counts in its window with a TTFT
  of `queue_timeout_s`. The controller sees the gateway as `pdplane.autoscale.scrape` reads
  it (an `InstanceSample` of role "gateway": requests waiting, requests shed or timed out).

Every `interval_s` a policy (`Policy`) sees what a controller would (`Observation`: the
engines' counters and load over the last `window_s`, the window's TTFT / ITL p90) and the
fleet's state, and answers the counts it wants; `plan_moves` turns them into starts and drains
under the GPU budget.

Measured: every `minute_s` window of arrivals meets the SLO when its requests' TTFT p90 and
the ITL p90 of the token gaps inside it are within the targets (a window without requests
meets it); goodput = requests with TTFT and mean ITL within target per second of traffic;
GPU-hours = the time every instance held its GPU(s), over the traffic's span.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdplane.autoscale.observe import GATEWAY, InstanceSample, Observation, TrafficWindow
from pdplane.autoscale.state import ROLES, FleetState, Move, RoleCount, plan_moves
from pdplane.plan.fleetsim import FIRST_FREE_EVENT, FleetConfig, FleetRun, Node, Req
from pdplane.plan.workload import RequestSpec
from pdplane.sim.profiles import Profile
from pdplane.sim.stats import LogHistogram

__all__ = ["ElasticResult", "ElasticSettings", "Policy", "Window", "simulate_elastic"]

_ARRIVE, _READY, _TICK, _MINUTE, _GIVE_UP = range(FIRST_FREE_EVENT, FIRST_FREE_EVENT + 5)

#: (observation, fleet state, now s) -> wanted instances per role, or None to keep the fleet
Policy = Callable[[Observation, FleetState, float], "dict[str, int] | None"]


@dataclass(frozen=True, slots=True)
class ElasticSettings:
    """Costs of a move and the controller's cadence (s), the SLO (s) and the GPU budget."""

    ttft_slo_s: float = 1.0
    itl_slo_s: float = 0.05
    gpus: int = 8
    startup_s: float = 90.0
    interval_s: float = 15.0
    window_s: float = 60.0
    minute_s: float = 60.0
    #: how long the run goes on after the last arrival (requests finish; not in GPU-hours)
    tail_s: float = 60.0
    #: the gateway's flow control (module docstring): `--inflight-budget` (0 = none: every
    #: request goes to the engines at once) and `--queue-timeout-s`; the drain rate's window
    inflight_budget: float = 0.0
    queue_timeout_s: float = 60.0
    drain_window_s: float = 10.0


@dataclass(frozen=True, slots=True)
class Window:
    """One `minute_s` window of arrivals: start (s), requests, TTFT / ITL p90 (s), verdict."""

    start: float
    requests: int
    ttft_p90_s: float
    itl_p90_s: float
    met: bool


@dataclass(slots=True)
class ElasticResult:
    """What one run measured (see the module docstring)."""

    windows: list[Window]
    requests: int
    good: int
    unfinished: int
    span_s: float
    gpu_seconds: float
    moves: list[tuple[float, Move]] = field(default_factory=list)
    #: (time s, fleet label) after each tick that changed something
    timeline: list[tuple[float, str]] = field(default_factory=list)
    #: requests the gateway's flow control shed or timed out (no token)
    shed: int = 0

    @property
    def attainment(self) -> float:
        """Fraction of windows meeting the SLO."""
        return sum(w.met for w in self.windows) / len(self.windows) if self.windows else 0.0

    @property
    def goodput(self) -> float:
        return self.good / self.span_s if self.span_s > 0 else 0.0

    @property
    def gpu_hours(self) -> float:
        return self.gpu_seconds / 3600.0


class _ElasticRun(FleetRun):
    def __init__(
        self,
        profile: Profile,
        config: FleetConfig,
        settings: ElasticSettings,
        policy: Policy | None,
    ) -> None:
        super().__init__(profile, config)
        self.settings = settings
        self.policy = policy
        self.names: dict[Node, str] = {}
        self.held_since: dict[Node, float] = {}
        self.held_until: dict[Node, float] = {}
        self.starting: dict[Node, bool] = {}  # node -> still wanted (False: stopped early)
        self.draining: set[Node] = set()
        self.requests: list[Req] = []
        self.arrivals: list[float] = []
        self.traffic_window = TrafficWindow(settings.window_s)
        self.itl_snaps: deque[tuple[float, LogHistogram]] = deque()
        self.minute_itl: list[LogHistogram] = []
        self.moves: list[tuple[float, Move]] = []
        self.timeline: list[tuple[float, str]] = []
        for node in self.every:
            self._hold(node, 0.0)
        # The gateway's flow control (module docstring).
        self.inflight_tokens = 0
        self.waiting: deque[tuple[int, Req]] = deque()  # (request number, request)
        self.waiting_ids: set[int] = set()  # id() of those
        self.waiting_tokens = 0
        self.shed: set[int] = set()  # id() of the requests shed or timed out
        self.finished_tokens: deque[tuple[float, int]] = deque()  # (time s, tokens)
        self.finished_sum = 0  # tokens in finished_tokens (kept, not summed per arrival)

    # --- the fleet's instances ------------------------------------------------------------
    def _hold(self, node: Node, now: float) -> None:
        self.names[node] = f"{node.role}-{len(self.names)}"
        self.held_since[node] = now

    def routable(self, role: str) -> list[Node]:
        return self.pre if role == "prefill" else self.dec

    def state(self) -> FleetState:
        roles = {}
        for role in ROLES:
            roles[role] = RoleCount(
                ready=len(self.routable(role)),
                starting=sum(1 for n, live in self.starting.items() if live and n.role == role),
                draining=sum(1 for n in self.draining if n.role == role),
            )
        return FleetState(roles)

    def start(self, role: str, now: float) -> None:
        node = self.new_node(role)
        self._hold(node, now)
        self.starting[node] = True
        self.push(now + self.settings.startup_s, _READY, node)

    def drain(self, role: str, now: float) -> None:
        early = [n for n, live in self.starting.items() if live and n.role == role]
        if early:  # not serving yet: stop it at once
            node = early[-1]
            self.starting[node] = False
            self.held_until[node] = now
            return
        group = self.routable(role)
        if len(group) <= 1:
            return
        node = min(group, key=lambda n: n.outstanding)
        group.remove(node)
        self.draining.add(node)
        self.settled(node, now)

    def settled(self, node: Node, now: float) -> None:
        if (
            node in self.draining
            and node.outstanding == 0
            and node.held == 0
            and node.loading_bytes == 0
            and not node.core.has_work
            and not node.core.loading
        ):
            self.draining.discard(node)
            self.held_until[node] = now

    # --- events -----------------------------------------------------------------------------
    # --- the gateway's flow control -------------------------------------------------------
    @staticmethod
    def _cost(r: Req) -> int:
        return r.spec.prompt_tokens + r.spec.output_tokens

    def _budget(self) -> float:
        kv_tokens = self.profile.num_blocks * self.profile.block_size
        return self.settings.inflight_budget * kv_tokens * len(self.dec)

    def _drain_rate(self, now: float) -> float:
        """Tokens per second of the requests that finished over the last `drain_window_s`;
        0 (no rate: nobody is shed on a projection) until they add up to the tokens in
        flight, as the gateway's (the first few to end say little of the rate)."""
        lo = now - self.settings.drain_window_s
        while self.finished_tokens and self.finished_tokens[0][0] < lo:
            self.finished_sum -= self.finished_tokens.popleft()[1]
        ended = self.finished_sum
        return ended / self.settings.drain_window_s if ended >= self.inflight_tokens else 0.0

    def _admit(self, i: int, r: Req, now: float) -> None:
        self.inflight_tokens += self._cost(r)
        self.send(i, r, now)

    def gate(self, i: int, r: Req, now: float) -> None:
        """A request at the gateway: sent, waiting for its turn, or shed."""
        if self.settings.inflight_budget <= 0:
            self.send(i, r, now)
            return
        cost = self._cost(r)
        if not self.waiting and self.inflight_tokens + cost <= self._budget():
            self._admit(i, r, now)
            return
        rate = self._drain_rate(now)
        if rate > 0 and (self.waiting_tokens + cost) / rate > self.settings.queue_timeout_s:
            self.shed.add(id(r))
            return
        self.waiting.append((i, r))
        self.waiting_ids.add(id(r))
        self.waiting_tokens += cost
        self.push(now + self.settings.queue_timeout_s, _GIVE_UP, r)

    def _dispatch(self, now: float) -> None:
        budget = self._budget()
        while self.waiting:
            i, r = self.waiting[0]
            if id(r) not in self.waiting_ids:  # timed out
                self.waiting.popleft()
                continue
            cost = self._cost(r)
            if self.inflight_tokens + cost > budget:
                return
            self.waiting.popleft()
            self.waiting_ids.discard(id(r))
            self.waiting_tokens -= cost
            self._admit(i, r, now)

    def ended(self, r: Req, now: float) -> None:
        if self.settings.inflight_budget <= 0:
            return
        cost = self._cost(r)
        self.inflight_tokens -= cost
        self.finished_tokens.append((now, cost))
        self.finished_sum += cost
        self._dispatch(now)

    def other(self, kind: int, obj: Any, now: float) -> None:
        if kind == _ARRIVE:
            i, spec = obj
            r = Req(spec, True)
            self.requests.append(r)
            self.gate(i, r, now)
        elif kind == _GIVE_UP:
            if id(obj) in self.waiting_ids:  # still waiting at the gateway: 429 or 503
                self.waiting_ids.discard(id(obj))
                self.shed.add(id(obj))
                self.waiting_tokens -= self._cost(obj)
                self._dispatch(now)  # the head may have been the one that left
        elif kind == _READY:
            if self.starting.pop(obj):
                self.every.append(obj)
                self.routable(obj.role).append(obj)
                if obj.role == "decode" and self.settings.inflight_budget > 0:
                    self._dispatch(now)  # the budget grew with the decodes' KV cache
        elif kind == _TICK:
            self.tick(now)
            self.push(now + self.settings.interval_s, _TICK, None)
        elif kind == _MINUTE:
            self.minute_itl.append(self.itl_total())
            self.push(now + self.settings.minute_s, _MINUTE, None)

    def itl_total(self) -> LogHistogram:
        out = LogHistogram()
        for n in self.every:
            if n.role == "decode":
                out = out.merge(n.core.stats.itl)
        return out

    def observe(self, now: float) -> Observation:
        samples = {}
        for node in [*self.pre, *self.dec, *self.draining]:
            st = node.core.stats
            samples[self.names[node]] = InstanceSample(
                node.role,
                st.finished,
                st.prompt_tokens,
                st.generation_tokens,
                node.core.num_running,
                node.core.num_waiting,
                node.core.pool.usage,
            )
        if self.settings.inflight_budget > 0:
            samples[GATEWAY] = InstanceSample(
                "gateway", float(len(self.shed)), 0.0, 0.0, waiting=float(len(self.waiting_ids))
            )
        self.traffic_window.add(now, samples)
        itl_now = self.itl_total()
        self.itl_snaps.append((now, itl_now))
        while len(self.itl_snaps) > 2 and self.itl_snaps[1][0] <= now - self.settings.window_s:
            self.itl_snaps.popleft()
        itl = itl_now.minus(self.itl_snaps[0][1])
        return self.traffic_window.observation(
            self.recent_ttft_p90(now), itl.quantile(0.9) if itl.total else math.nan
        )

    def recent_ttft_p90(self, now: float) -> float:
        """TTFT p90 of the requests whose first token came in the last window, and of those
        still without one after the TTFT target (counted with their wait so far): what the
        gateway's histogram shows, plus the queue it cannot see yet."""
        lo = now - self.settings.window_s
        start = bisect.bisect_left(self.arrivals, lo - 4 * self.settings.window_s)
        hist = LogHistogram()
        for r in self.requests[start:]:
            er = r.served
            if id(r) in self.shed:
                continue  # answered 429 / 503: not in the gateway's TTFT histogram
            if er is not None and er.first_token_at >= 0:
                if er.first_token_at > lo:
                    hist.add(max(er.first_token_at - r.arrival, 1e-6))
            elif now - r.arrival > self.settings.ttft_slo_s:
                hist.add(now - r.arrival)
        return hist.quantile(0.9) if hist.total else math.nan

    def tick(self, now: float) -> None:
        obs = self.observe(now)
        if self.policy is None:
            return
        state = self.state()
        wanted = self.policy(obs, state, now)
        if not wanted:
            return
        moves = plan_moves(wanted, state, self.settings.gpus)
        for move in moves:
            (self.start if move.action == "start" else self.drain)(move.role, now)
            self.moves.append((now, move))
        if moves:
            self.timeline.append((now, self.state().label))


def _windows(
    run: _ElasticRun, span: float, settings: ElasticSettings, stopped_at: float
) -> tuple[list[Window], int, int]:
    n = max(1, math.ceil(span / settings.minute_s - 1e-9))
    ttft = [LogHistogram() for _ in range(n)]
    good = unfinished = 0
    for r in run.requests:
        k = min(int(r.arrival // settings.minute_s), n - 1)
        er = r.served
        if id(r) in run.shed:  # no token: it counts as a wait of the whole timeout
            ttft[k].add(settings.queue_timeout_s)
            continue
        if er is None or er.first_token_at < 0:
            ttft[k].add(max(stopped_at - r.arrival, 1e-6))
            unfinished += 1
            continue
        t = er.first_token_at - r.arrival
        ttft[k].add(max(t, 1e-6))
        m = er.num_output
        tpot = (er.last_token_at - er.first_token_at) / (m - 1) if m > 1 else 0.0
        unfinished += not er.finished
        good += t <= settings.ttft_slo_s and tpot <= settings.itl_slo_s
    snaps = run.minute_itl
    out = []
    for k in range(n):
        itl = snaps[k + 1].minus(snaps[k]) if k + 1 < len(snaps) else LogHistogram()
        t90 = ttft[k].quantile(0.9) if ttft[k].total else 0.0
        i90 = itl.quantile(0.9) if itl.total else 0.0
        met = t90 <= settings.ttft_slo_s and i90 <= settings.itl_slo_s
        out.append(Window(k * settings.minute_s, ttft[k].total, t90, i90, met))
    return out, good, unfinished


def simulate_elastic(
    profile: Profile,
    requests: Sequence[RequestSpec],
    start: tuple[int, int],
    settings: ElasticSettings,
    policy: Policy | None = None,
    *,
    span_s: float | None = None,
) -> ElasticResult:
    """Serves `requests` (sorted by arrival) on a fleet that starts as `start` (prefill, decode;
    ready at time 0) and changes as `policy` asks (None: a static fleet); see the module
    docstring for what is measured over `span_s` (default: up to the last arrival).

    Deterministic: the same inputs give the same result. Raises ValueError for a start with
    fewer than one instance of a role or over the budget.
    """
    x, y = start
    if x < 1 or y < 1:
        raise ValueError(f"start fleet {x}P{y}D: at least one prefill and one decode")
    if settings.gpus and x + y > settings.gpus:
        raise ValueError(f"start fleet {x}P{y}D exceeds the budget of {settings.gpus} GPUs")
    run = _ElasticRun(profile, FleetConfig(prefill=x, decode=y), settings, policy)
    span = span_s if span_s is not None else max((r.at for r in requests), default=0.0)
    for i, spec in enumerate(requests):
        run.arrivals.append(spec.at)
        run.push(spec.at, _ARRIVE, (i, spec))
    run.push(settings.interval_s, _TICK, None)
    run.push(0.0, _MINUTE, None)
    stopped_at = run.run(span + settings.tail_s)
    windows, good, unfinished = _windows(run, span, settings, stopped_at)
    gpu_s = sum(min(run.held_until.get(n, span), span) - t for n, t in run.held_since.items())
    return ElasticResult(
        windows,
        len(run.requests),
        good,
        unfinished,
        span,
        max(gpu_s, 0.0),
        run.moves,
        run.timeline,
        len(run.shed),
    )
