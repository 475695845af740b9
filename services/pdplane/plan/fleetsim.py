"""A whole XpYd (or plain) fleet of simulated engines on one virtual clock.

Every instance is a `pdplane.sim.engine.EngineCore` (the engine model `pdplane sim` serves,
unchanged); this module only replaces the served simulator's real-time runner with a
discrete-event loop (a heap of timed events, nothing sleeps), so a fleet serving minutes of
traffic runs in seconds of CPU. What it models around the engines, after the gateway's
sequential dispatch (docs/gateway.md) and the connector's pull mode (docs/connector.md):

- a request enters an engine when that instance's API server lets it in
  (`pdplane.sim.frontend`: `cost.serial_request_ms` on one FIFO per instance, then
  `cost.request_ms`), both on the prefill and on the decode;
- disaggregated: the prefill computes the prompt and one token and keeps its KV blocks; the
  request then goes to a decode, which allocates blocks for the prompt, waits for the pull
  (`transfer_latency_ms + prompt KV bytes / transfer_gbps`), recomputes the last prompt token
  and decodes; the prefill's blocks are freed when the pull ends. With `first_token="decode"`
  (`--first-token decode`) the client's first token is the decode's first token (TTFT counts
  prefill queue + prefill + pull + decode admission); with "prefill" (the gateway's default,
  docs/first-token.md) it is the prefill's one token, and the decode gets the prompt plus that
  token, computes the appended token after the pull and yields tokens 2..n (the gap from the
  first token to the second, pull and decode admission included, is an ITL sample; a request
  for one token still goes to decode, which the gateway skips);
- plain: every instance serves whole requests (role `both`);
- routing: least outstanding work — prefill by unfinished prompt tokens, decode and plain by
  unfinished requests (the scheduler's `least_loaded` in spirit, without heartbeat lag); or,
  with a `FleetRouter` (disaggregated fleets), the router's choice of both legs when the request
  arrives (the scheduler's real policies: `pdplane.plan.routesim`), with the prompt's token ids,
  so prefix caches hit, a request may skip prefill (its decode computes the prompt) and a
  finished request may send follow-ups (multi-turn).

Measured window: requests arriving in [warmup_s, last arrival]; ITL counts token gaps inside
that window (all requests); the run stops `tail_s` after the last arrival, so a request of the
window without a first token by then gets TTFT = stop - arrival (a lower bound: it failed).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdplane.plan.fleet_routing import FleetEngines, FleetRouter, Routed
from pdplane.plan.workload import RequestSpec
from pdplane.sim.engine import EngineCore, EngineLimits, EngineRequest, Phase, Step
from pdplane.sim.frontend import Frontend
from pdplane.sim.profiles import Profile
from pdplane.sim.stats import LogHistogram

__all__ = [
    "FIRST_FREE_EVENT",
    "FIRST_TOKEN_MODES",
    "FleetConfig",
    "FleetEngines",
    "FleetResult",
    "FleetRouter",
    "FleetRun",
    "Node",
    "Req",
    "RoleStats",
    "Routed",
    "simulate_fleet",
]

#: event kinds; a subclass numbers its own from `FIRST_FREE_EVENT` on (see `FleetRun.other`)
_ADD, _STEP_END, _LOAD_DONE, _SNAPSHOT, _ARRIVE, _TICK = 0, 1, 2, 3, 4, 5
FIRST_FREE_EVENT = 6
_NO_STREAM = 1 << 30  # the waiters are ours: wake only on the first and the last token
#: where the client's first token of a disaggregated request comes from (docs/first-token.md)
FIRST_TOKEN_MODES = ("decode", "prefill")


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """Instance counts and the engine flags per role (None = the profile's value)."""

    prefill: int = 0
    decode: int = 0
    plain: int = 0
    prefill_max_num_seqs: int | None = None
    prefill_max_num_batched_tokens: int | None = None
    decode_max_num_seqs: int | None = None
    decode_max_num_batched_tokens: int | None = None

    @property
    def disaggregated(self) -> bool:
        return self.plain == 0

    @property
    def instances(self) -> int:
        return self.prefill + self.decode + self.plain

    @property
    def label(self) -> str:
        return f"{self.prefill}P{self.decode}D" if self.disaggregated else f"{self.plain} plain"


@dataclass(slots=True)
class RoleStats:
    """One role's instances over the window: busy fraction (0..1), mean running requests,
    mean KV cache usage (0..1), preemptions, peak KV bytes waiting for a pull per instance."""

    instances: int
    utilisation: float
    mean_running: float
    mean_kv_usage: float
    preemptions: int
    peak_loading_bytes: int = 0


@dataclass(slots=True)
class FleetResult:
    """Predicted latencies (s) and goodput (req/s) of one fleet over the measured window."""

    config: FleetConfig
    requests: int
    ttft: LogHistogram
    itl: LogHistogram
    good: int
    window_s: float
    roles: dict[str, RoleStats] = field(default_factory=dict)
    unfinished: int = 0
    #: With the first token from prefill: the gaps from the first token to the second (the
    #: pull, decode's admission and its step; s), which `itl` holds too, one per request.
    handoff: LogHistogram = field(default_factory=LogHistogram)

    def ttft_q(self, q: float) -> float:
        return self.ttft.quantile(q)

    def itl_q(self, q: float) -> float:
        return self.itl.quantile(q)

    @property
    def goodput(self) -> float:
        """Requests of the window meeting both targets per second."""
        return self.good / self.window_s if self.window_s > 0 else 0.0


class Node:
    __slots__ = (
        "busy",
        "busy_s",
        "core",
        "frontend",
        "held",
        "loading_bytes",
        "outstanding",
        "peak_loading",
        "role",
    )

    def __init__(self, role: str, core: EngineCore) -> None:
        self.role = role
        self.core = core
        self.frontend = Frontend(core.cost)
        self.busy = False
        self.busy_s = 0.0
        self.outstanding = 0  # routing load: prompt tokens (prefill) or requests
        self.loading_bytes = 0
        self.peak_loading = 0
        self.held = 0  # a prefill's finished requests whose KV blocks wait for a pull


class Req:
    """The caller's side of a request (the engines' `EngineRequest.waiter`)."""

    __slots__ = (
        "arrival",
        "decode_node",
        "first_at",
        "index",
        "measured",
        "node",
        "outputs",
        "prefill",
        "prefill_node",
        "served",
        "spec",
    )

    def __init__(self, spec: RequestSpec, measured: bool, index: int = 0) -> None:
        self.spec = spec
        self.arrival = spec.at
        self.measured = measured
        self.index = index
        self.node: Node | None = None
        self.prefill: EngineRequest | None = None
        self.prefill_node: Node | None = None
        #: routed runs: the decode chosen on arrival and the output token ids
        self.decode_node: Node | None = None
        self.outputs: Sequence[int] = ()
        #: the engine request whose tokens the client sees (decode's or plain's)
        self.served: EngineRequest | None = None
        #: first token from prefill: when the client had it (s; -1 until then)
        self.first_at = -1.0


def _limits(profile: Profile, seqs: int | None, tokens: int | None) -> EngineLimits:
    return EngineLimits(
        num_blocks=profile.num_blocks,
        block_size=profile.block_size,
        max_num_seqs=seqs or profile.max_num_seqs,
        max_num_batched_tokens=tokens or profile.max_num_batched_tokens,
        stream_interval=_NO_STREAM,
    )


def _tokens(base: int, n: int) -> range:
    # Unique ids per request (no prefix hits between requests); a range costs no memory.
    return range(base, base + n)


@dataclass(frozen=True, slots=True)
class _Snapshot:
    itl: list[LogHistogram]
    busy: list[float]
    running: list[float]
    kv: list[float]
    preemptions: list[int]


class FleetRun:
    """The event loop of one fleet (state shared by the event handlers).

    `simulate_fleet` runs a fixed fleet with it; a subclass changes the fleet while it runs
    (`pdplane.autoscale.elastic`): `pre` / `dec` / `plain` hold the instances that take new requests
    (routing picks among them only), `every` each instance that ever ran, `settled` is called
    after each event that may leave an instance without work, `other` handles the event kinds
    the subclass pushes."""

    def __init__(
        self,
        profile: Profile,
        config: FleetConfig,
        router: FleetRouter | None = None,
        first_token: str = "decode",
    ) -> None:
        if first_token not in FIRST_TOKEN_MODES:
            raise ValueError(f"first_token: one of {', '.join(FIRST_TOKEN_MODES)}")
        self.profile = profile
        self.config = config
        self.router = router
        self.first_from_prefill = first_token == "prefill"
        self.kv_per_token = profile.kv_bytes_per_token
        self.gbps = profile.transfer_gbps
        self.latency = profile.transfer_latency_ms * 1e-3
        self.pre = [self.new_node("prefill") for _ in range(config.prefill)]
        self.dec = [self.new_node("decode") for _ in range(config.decode)]
        self.plain = [self.new_node("plain") for _ in range(config.plain)]
        self.serving = self.dec if config.disaggregated else self.plain
        self.every = self.pre + self.dec + self.plain
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.snaps: dict[int, _Snapshot] = {}
        # Routed runs: follow-ups join the window when they arrive in [warmup, end].
        self.window: list[Req] = []
        self.bounds = (0.0, 0.0)
        self.next_index = 0

    def new_node(self, role: str) -> Node:
        """A fresh instance of `role` (prefill | decode | plain) with the config's flags."""
        c = self.config
        seqs, toks = {
            "prefill": (c.prefill_max_num_seqs, c.prefill_max_num_batched_tokens),
            "decode": (c.decode_max_num_seqs, c.decode_max_num_batched_tokens),
            "plain": (c.decode_max_num_seqs, None),
        }[role]
        return Node(role, EngineCore(_limits(self.profile, seqs, toks), self.profile.cost))

    def push(self, t: float, kind: int, obj: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, obj))

    def send(self, i: int, r: Req, now: float | None = None) -> None:
        """Routes a new request to its first engine (prefill, or a plain instance) at `now`
        (s; default its arrival)."""
        spec = r.spec
        at = spec.at if now is None else now
        base = i << 20
        prompt = _tokens(base, spec.prompt_tokens)
        if self.config.disaggregated:
            node = min(self.pre, key=lambda n: n.outstanding)
            node.outstanding += spec.prompt_tokens
            er = EngineRequest(str(i), prompt, range(1), hold=True)
            r.prefill_node = node
        else:
            node = min(self.plain, key=lambda n: n.outstanding)
            node.outstanding += 1
            er = EngineRequest(
                str(i), prompt, _tokens(base + spec.prompt_tokens, spec.output_tokens)
            )
        er.waiter = r
        self.push(node.frontend.admit(at), _ADD, (node, er))

    def arrive(self, r: Req, now: float) -> None:
        """A routed request arrives: the router picks its legs and it goes to the first."""
        assert self.router is not None
        routed = self.router.route(r.index, r.spec, now)
        if routed is None:  # no room now: the request waits (its TTFT counts from arrival)
            self.push(now + self.router.retry_s, _ARRIVE, r)
            return
        r.outputs = routed.outputs
        if routed.warm is not None:  # a request of its own: nobody waits for it
            w, tokens = routed.warm
            node = self.pre[w]
            node.outstanding += tokens
            warm = EngineRequest(f"warm-{r.index}", routed.prompt[:tokens], range(1))
            self.push(node.frontend.admit(now), _ADD, (node, warm))
        d = self.dec[routed.decode]
        d.outstanding += 1
        if routed.prefill is None:  # the decode computes the prompt itself
            er = EngineRequest(str(r.index), routed.prompt, routed.outputs)
            er.waiter = r
            self.push(d.frontend.admit(now), _ADD, (d, er))
            return
        r.decode_node = d
        node = r.prefill_node = self.pre[routed.prefill]
        node.outstanding += len(routed.prompt)
        er = EngineRequest(str(r.index), routed.prompt, range(1), hold=True)
        er.waiter = r
        self.push(node.frontend.admit(now), _ADD, (node, er))

    def follow_up(self, spec: RequestSpec) -> None:
        """Schedules a request a router sent after another finished."""
        warmup, end = self.bounds
        r = Req(spec, warmup <= spec.at <= end, self.next_index)
        self.next_index += 1
        if r.measured:
            self.window.append(r)
        self.push(spec.at, _ARRIVE, r)

    def kick(self, node: Node, now: float) -> None:
        """Starts the node's next step if it is idle and has work."""
        if node.busy or not node.core.has_work:
            return
        step = node.core.schedule(now)
        for er in step.loads:
            nbytes = (len(er.prompt) - er.local_hit) * self.kv_per_token
            node.loading_bytes += nbytes
            node.peak_loading = max(node.peak_loading, node.loading_bytes)
            t = self.latency + (nbytes / (self.gbps * 1e9) if self.gbps else 0.0)
            self.push(now + t, _LOAD_DONE, (node, er, nbytes))
        if step.batch:
            node.busy = True
            dt = step.duration_ms * 1e-3
            node.busy_s += dt
            self.push(now + dt, _STEP_END, (node, step))

    def step_end(self, node: Node, step: Step, now: float) -> None:
        node.busy = False
        for er in node.core.complete(step, now):
            if er.phase != Phase.DONE:
                continue
            if er.waiter is None:  # a prefix warm
                node.outstanding -= len(er.prompt)
                continue
            r = er.waiter
            assert isinstance(r, Req)
            if node.role != "prefill":
                node.outstanding -= 1
                self.ended(r, now)
                if self.router is not None:
                    for spec in self.router.finished(r.index, er, r.prefill, now):
                        self.follow_up(spec)
                continue
            node.outstanding -= len(er.prompt)
            node.held += 1
            r.prefill = er
            spec = r.spec
            if r.decode_node is not None:  # routed: the decode chosen on arrival
                assert self.router is not None
                self.router.prefill_done(r.index, er, now)
                d, out = r.decode_node, r.outputs
            else:  # the prefill is done: the request goes to the least loaded decode
                d = min(self.dec, key=lambda n: n.outstanding)
                d.outstanding += 1
                out = _tokens((int(er.request_id) << 20) + spec.prompt_tokens, spec.output_tokens)
            prompt: Sequence[int] = er.prompt
            if self.first_from_prefill and len(out) > 1:
                # The client has its first token; decode continues after it (the prompt one
                # token longer than the KV it pulls, docs/first-token.md).
                r.first_at = now
                prompt, out = [*er.prompt, out[0]], out[1:]
            der = EngineRequest(er.request_id, prompt, out, remote_tokens=len(er.prompt))
            der.waiter = r
            self.push(d.frontend.admit(now), _ADD, (d, der))
        self.kick(node, now)
        self.settled(node, now)

    def add(self, node: Node, er: EngineRequest, now: float) -> None:
        node.core.add(er, now)
        if node.role != "prefill":
            r = er.waiter
            assert isinstance(r, Req)
            r.served = er
        self.kick(node, now)

    def load_done(self, node: Node, er: EngineRequest, nbytes: int, now: float) -> None:
        node.loading_bytes -= nbytes
        node.core.load_done(er, True, now)
        r = er.waiter
        assert isinstance(r, Req)
        if r.prefill is not None and r.prefill_node is not None:
            r.prefill_node.core.release(r.prefill.blocks)  # the pull ended: prefill frees
            r.prefill.blocks = []
            r.prefill_node.held -= 1
            self.settled(r.prefill_node, now)
        self.kick(node, now)

    def snapshot(self, which: int, now: float) -> None:
        for n in self.every:
            n.core.sample(now)
        st = [n.core.stats for n in self.every]
        self.snaps[which] = _Snapshot(
            [n.core.stats.itl.merge(LogHistogram()) for n in self.serving],
            [n.busy_s for n in self.every],
            [s.running_integral for s in st],
            [s.kv_usage_integral for s in st],
            [s.preemptions for s in st],
        )

    def run(self, stop: float) -> float:
        """Processes events until none is left or the next is after `stop`; returns the time
        the run ended."""
        now = 0.0
        events = self.events
        while events:
            if events[0][0] > stop:
                return stop
            now, _, kind, obj = heapq.heappop(events)
            if kind == _STEP_END:
                self.step_end(obj[0], obj[1], now)
            elif kind == _ADD:
                self.add(obj[0], obj[1], now)
            elif kind == _LOAD_DONE:
                self.load_done(obj[0], obj[1], obj[2], now)
            elif kind == _ARRIVE:
                self.arrive(obj, now)
            elif kind == _TICK:
                assert self.router is not None
                self.router.tick(now)
                self.push(now + self.router.tick_s, _TICK, None)
            elif kind == _SNAPSHOT:
                self.snapshot(obj, now)
            else:
                self.other(kind, obj, now)
        return now

    def settled(self, node: Node, now: float) -> None:
        """Called after an event that may have left `node` without work (here: nothing)."""

    def ended(self, r: Req, now: float) -> None:
        """Called when request `r` finished on the instance serving it (here: nothing)."""

    def other(self, kind: int, obj: Any, now: float) -> None:
        """Handles an event kind >= `FIRST_FREE_EVENT` (a subclass's)."""
        raise ValueError(f"unknown event kind {kind}")

    def roles(self, span: float) -> dict[str, RoleStats]:
        s0, s1 = self.snaps.get(0), self.snaps.get(1)
        out: dict[str, RoleStats] = {}
        for role, group in (("prefill", self.pre), ("decode", self.dec), ("plain", self.plain)):
            if not group:
                continue
            idx = [i for i, n in enumerate(self.every) if n.role == role]
            k = span * len(idx)
            if k <= 0 or s0 is None or s1 is None:
                stats = (0.0, 0.0, 0.0, 0)
            else:
                stats = (
                    sum(s1.busy[i] - s0.busy[i] for i in idx) / k,
                    sum(s1.running[i] - s0.running[i] for i in idx) / k,
                    sum(s1.kv[i] - s0.kv[i] for i in idx) / k,
                    sum(s1.preemptions[i] - s0.preemptions[i] for i in idx),
                )
            peak = max(n.peak_loading for n in group)
            out[role] = RoleStats(
                len(group), min(stats[0], 1.0), stats[1], stats[2], stats[3], peak
            )
        return out

    def itl(self) -> LogHistogram:
        out = LogHistogram()
        s0, s1 = self.snaps.get(0), self.snaps.get(1)
        if s0 is not None and s1 is not None:
            for a, b in zip(s1.itl, s0.itl, strict=True):
                out = out.merge(a.minus(b))
        return out


def simulate_fleet(
    profile: Profile,
    requests: Sequence[RequestSpec],
    config: FleetConfig,
    *,
    ttft_slo_s: float,
    itl_slo_s: float,
    warmup_s: float = 0.0,
    tail_s: float | None = None,
    router: FleetRouter | None = None,
    first_token: str = "decode",
) -> FleetResult:
    """Runs `requests` on the fleet `config` in modelled time and measures the window.

    Goodput counts window requests whose TTFT <= `ttft_slo_s` and mean ITL (TPOT, over the
    tokens they got before the stop) <= `itl_slo_s`. `tail_s` (default 2 x `ttft_slo_s`):
    how long after the last arrival the run goes on. `router` (disaggregated fleets): chooses
    each request's legs and token ids (`FleetRouter`); its follow-ups arriving in the window
    count in it. `first_token`: where a disaggregated request's first token comes from
    (`FIRST_TOKEN_MODES`, module doc). Raises ValueError for an empty fleet, a router on a
    plain fleet, a request longer than the profile's context, or an unknown `first_token`.
    """
    if config.disaggregated and (config.prefill < 1 or config.decode < 1):
        raise ValueError("a disaggregated fleet needs at least one prefill and one decode")
    if config.instances < 1:
        raise ValueError("an empty fleet")
    if router is not None and not config.disaggregated:
        raise ValueError("a router routes disaggregated fleets only")
    for spec in requests:
        if spec.prompt_tokens + spec.output_tokens > profile.max_model_len:
            raise ValueError(
                f"request of {spec.prompt_tokens}+{spec.output_tokens} tokens exceeds "
                f"max_model_len {profile.max_model_len} of profile {profile.name}"
            )
    fleet = FleetRun(profile, config, router, first_token)
    end = max((r.at for r in requests), default=0.0)
    warmup_s = min(warmup_s, end)
    stop = end + (2 * ttft_slo_s if tail_s is None else tail_s)
    window = fleet.window
    fleet.bounds = (warmup_s, end)
    fleet.next_index = len(requests)
    if router is not None:
        router.start(FleetEngines([n.core for n in fleet.pre], [n.core for n in fleet.dec]))
        if router.tick_s > 0:
            fleet.push(0.0, _TICK, None)
    # In arrival order: each instance's API server is a FIFO (`Frontend.admit`).
    for i, spec in sorted(enumerate(requests), key=lambda p: p[1].at):
        r = Req(spec, warmup_s <= spec.at <= end, i)
        if r.measured:
            window.append(r)
        if router is None:
            fleet.send(i, r)
        else:  # routed on arrival, in time order with everything else
            fleet.push(spec.at, _ARRIVE, r)
    fleet.push(warmup_s, _SNAPSHOT, 0)
    fleet.push(end, _SNAPSHOT, 1)
    stopped_at = fleet.run(stop)

    ttft = LogHistogram()
    handoff = LogHistogram()  # first token from prefill: the gaps from token 1 to token 2
    good = unfinished = 0
    for r in window:
        er = r.served
        if er is not None and er.first_token_at < 0:
            er = None  # its engine has not answered yet
        if r.first_at >= 0:
            first = r.first_at
        elif er is not None:
            first = er.first_token_at
        else:
            ttft.add(max(stopped_at - r.arrival, 1e-6))  # no first token: a lower bound
            unfinished += 1
            continue
        t = first - r.arrival
        ttft.add(max(t, 1e-6))
        if er is None:  # the first token only: decode never answered
            unfinished += 1
            continue
        n = er.num_output + (r.first_at >= 0)
        if r.first_at >= 0:
            handoff.add(max(er.first_token_at - r.first_at, 1e-6))
        tpot = (er.last_token_at - first) / (n - 1) if n > 1 else 0.0
        if not er.finished:
            unfinished += 1
        if t <= ttft_slo_s and tpot <= itl_slo_s:
            good += 1
    span = end - warmup_s
    itl = fleet.itl().merge(handoff) if handoff.total else fleet.itl()
    return FleetResult(
        config,
        len(window),
        ttft,
        itl,
        good,
        max(span, 1e-9),
        fleet.roles(span),
        unfinished,
        handoff,
    )
