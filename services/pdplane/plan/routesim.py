"""Routing on the virtual clock: the scheduler's own decision code over a `fleetsim` fleet.

`simulate_fleet(..., router=...)` (`pdplane.plan.fleetsim`) runs a disaggregated fleet of
simulated engines (`pdplane.sim.engine`, the model `pdplane sim` serves) on a virtual clock;
the routers here choose each request's legs:

- `SchedulerRouter`: a real `Decider` (any policies, `kv_aware`'s options) over a
  `StaticSource` that the engines' load reports update every `heartbeat_s` (each instance at
  its own phase, only when its load changed, as the registry publishes them), the scheduler's
  in-flight accounting on the virtual clock, and a real `PrefixIndex` fed by every engine's KV
  cache events as they happen (no stream delay). Keys: the engines' content-chained block keys
  (`pdplane.sim.kv_cache.chain_hashes`) stand for pdplane's own hashes on both sides (the
  request's and the index's), which only renames them. Releases when the decode finishes.
- `OracleRouter`: the benchmark's cache-knowing oracle (bench/routing/_oracle.py): reads every
  engine's prefix cache directly and exactly; prefill where `uncached prompt tokens + uncached
  tokens sent there and not yet prefilled` is lowest (ties: the longest hit), decode with the
  fewest unfinished requests (ties: the longest hit). A heuristic with perfect information,
  not a bound: it predicts no latency and never skips prefill.

Traffic is chat sessions (`ChatTraffic`): token ids as the simulator's word tokenizer gives
them (chat template included), answers as the served simulator samples them, so a follow-up
turn carries the previous answer's exact ids and its prefix is cached where the turn ran.
Everything is a function of the inputs and the seed: a run is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdplane.core.kv_events.log import DEFAULT_MEDIUM
from pdplane.plan.fleet_routing import FleetEngines, Routed
from pdplane.plan.fleetsim import FleetConfig, FleetResult, simulate_fleet
from pdplane.plan.workload import RequestSpec
from pdplane.scheduler.decision import Decider
from pdplane.scheduler.errors import NoRoom
from pdplane.scheduler.inflight import InflightTracker
from pdplane.scheduler.kv_index import InstanceBlocks, KvState, PrefixIndex
from pdplane.scheduler.local import decision_options
from pdplane.scheduler.port import Outcome, RequestFeatures
from pdplane.scheduler.settings import PolicySettings
from pdplane.scheduler.view import CandidateView, StaticSource
from pdplane.sim.engine import EngineCore, EngineRequest
from pdplane.sim.kv_cache import chain_hashes
from pdplane.sim.profiles import Profile
from pdplane.sim.tokens import WordTokenizer, prompt_key
from pdplane.v1 import instance_pb2

__all__ = [
    "ChatTraffic",
    "ChatTurn",
    "OracleRouter",
    "RouteStats",
    "SchedulerRouter",
    "run_routed",
]

MODEL = "sim-model"


@dataclass(slots=True)
class ChatTurn:
    """One request of a session: `at` is the arrival (s) of a session's first turn, or the
    think time after the previous answer of a follow-up; `messages` its new chat messages
    (a follow-up's history is prepended); `max_tokens` the answer's length."""

    at: float
    messages: list[dict[str, str]]
    max_tokens: int


class ChatTraffic:
    """Sessions of chat turns as token ids (the simulator's word tokenizer and sampler).

    `requests` are the sessions' first turns (index = session); follow-ups get the indices
    the fleet gives them (`follow_up`).
    """

    def __init__(self, sessions: Sequence[Sequence[ChatTurn]], seed: int = 0) -> None:
        self._tok = WordTokenizer()
        self._seed = seed
        self._parts: dict[tuple[str, str], list[int]] = {}
        self._primer = self._tok.encode_chat([])
        self._sessions = [list(s) for s in sessions if s]
        self.requests = [
            RequestSpec(s[0].at, self._length(s[0].messages), s[0].max_tokens)
            for s in self._sessions
        ]
        # request index -> (session, turn, history before it)
        self._state: dict[int, tuple[int, int, list[dict[str, str]]]] = {
            i: (i, 0, []) for i in range(len(self._sessions))
        }
        self._prompts: dict[int, list[int]] = {}
        self._answers: dict[int, tuple[list[int], str]] = {}

    def _part(self, m: dict[str, str]) -> list[int]:
        key = (m.get("role", ""), m.get("content", ""))
        part = self._parts.get(key)
        if part is None:
            part = self._parts[key] = self._tok.encode_chat([m])[: -len(self._primer)]
        return part

    def _length(self, messages: list[dict[str, str]]) -> int:
        return sum(len(self._part(m)) for m in messages) + len(self._primer)

    def prompt(self, request: int) -> list[int]:
        """The request's prompt token ids (history and template included)."""
        ids = self._prompts.get(request)
        if ids is None:
            session, turn, history = self._state[request]
            ids = []
            for m in history + self._sessions[session][turn].messages:
                ids += self._part(m)
            ids += self._primer
            self._prompts[request] = ids
        return ids

    def outputs(self, request: int, max_tokens: int) -> list[int]:
        """The answer's token ids, as the served simulator samples them for this prompt."""
        ids, pieces = self._tok.sample(prompt_key(self.prompt(request)), self._seed, max_tokens)
        self._answers[request] = (ids, "".join(pieces))
        return ids

    def follow_up(self, request: int, index: int, now: float) -> RequestSpec | None:
        """The session's next turn after `request` finished at `now` (its id: `index`), or
        None; forgets `request`'s tokens."""
        self._prompts.pop(request, None)
        _, text = self._answers.pop(request, ([], ""))
        session, turn, history = self._state.pop(request)
        turns = self._sessions[session]
        if turn + 1 >= len(turns):
            return None
        done = turns[turn]
        history = [*history, *done.messages, {"role": "assistant", "content": text}]
        nxt = turns[turn + 1]
        self._state[index] = (session, turn + 1, history)
        return RequestSpec(now + nxt.at, self._length(history + nxt.messages), nxt.max_tokens)


@dataclass(slots=True)
class RouteStats:
    """What the router saw of the measured window's requests (tokens and counts)."""

    requests: int = 0
    prompt_tokens: int = 0
    #: prompt tokens the computing leg found in its prefix cache (prefill, or decode without one)
    hit_tokens: int = 0
    prefill_legs: int = 0
    #: prompt tokens a disaggregated request's decode already held (not pulled)
    decode_hit_tokens: int = 0
    #: prefix warms sent (the whole run, warm-up included) and their tokens
    warms: int = 0
    warm_tokens: int = 0

    @property
    def fleet_hit(self) -> float:
        """1 - prompt tokens computed / prompt tokens (the routing benchmark's fleet hit)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_legs_per_request(self) -> float:
        return self.prefill_legs / self.requests if self.requests else 0.0


class _Router:
    """What both routers share: the traffic, follow-ups and the window's stats."""

    tick_s = 0.0
    #: how often a request without room asks again (s; the gateway's wait, docs/gateway.md)
    retry_s = 0.025

    def __init__(self, traffic: ChatTraffic, window: tuple[float, float]) -> None:
        self.traffic = traffic
        self.window = window
        self.stats = RouteStats()
        self._arrived: dict[int, float] = {}
        self._follow_ups = 0
        self.engines = FleetEngines([], [])

    def start(self, engines: FleetEngines) -> None:
        self.engines = engines

    def prefill_done(self, request: int, prefill: EngineRequest, now: float) -> None:
        return None

    def tick(self, now: float) -> None:
        return None

    def _outputs(self, request: int, spec: RequestSpec) -> list[int]:
        """The answer's ids of a request routed now (it arrived at `spec.at`)."""
        self._arrived[request] = spec.at
        return self.traffic.outputs(request, spec.output_tokens)

    def finished(
        self, request: int, served: EngineRequest, prefill: EngineRequest | None, now: float
    ) -> Sequence[RequestSpec]:
        arrived = self._arrived.pop(request, -1.0)
        lo, hi = self.window
        if lo <= arrived <= hi:
            s = self.stats
            s.requests += 1
            # prefill's prompt: with the first token from prefill decode's is one token longer
            s.prompt_tokens += len(served.prompt if prefill is None else prefill.prompt)
            if prefill is None:
                s.hit_tokens += served.local_hit
            else:
                s.prefill_legs += 1
                s.hit_tokens += prefill.local_hit
                s.decode_hit_tokens += served.local_hit
        self.released(request, now)
        # fleetsim numbers follow-ups in the order it receives them, from len(requests) on
        index = len(self.traffic.requests) + self._follow_ups
        nxt = self.traffic.follow_up(request, index, now)
        if nxt is None:
            return []
        self._follow_ups += 1
        return [nxt]

    def released(self, request: int, now: float) -> None:
        return None


class _IndexSink:
    """An engine's KV cache events into its `InstanceBlocks` (engine keys as own hashes)."""

    __slots__ = ("inst",)

    def __init__(self, inst: InstanceBlocks) -> None:
        self.inst = inst

    def stored(
        self, block_hashes: list[int], parent_hash: int | None, token_ids: list[int], bs: int
    ) -> None:
        self.inst.stored_own(DEFAULT_MEDIUM, block_hashes, block_hashes)

    def removed(self, block_hashes: list[int]) -> None:
        self.inst.removed(block_hashes)

    def cleared(self) -> None:
        self.inst.clear()


def _spec(instance_id: str, role: int, profile: Profile) -> instance_pb2.InstanceSpec:
    return instance_pb2.InstanceSpec(
        instance_id=instance_id,
        role=role,  # type: ignore[arg-type]
        model=MODEL,
        url=f"http://{instance_id}.sim",
        kv_endpoint=f"{instance_id}.sim:1",
        transport=instance_pb2.TRANSPORT_NCCL,
        tp_size=1,
        kv_layout=instance_pb2.KvLayout(
            num_layers=profile.num_layers,
            num_kv_heads=profile.num_kv_heads,
            head_size=profile.head_size,
            block_size=profile.block_size,
            dtype=profile.kv_dtype,
        ),
        max_model_len=profile.max_model_len,
        version="routesim",
    )


class SchedulerRouter(_Router):
    """A `Decider` on the virtual clock (module doc).

    `service` keyword arguments go to `Decider` (policies, `kv_weights`,
    `local_prefill_max_tokens`, ...); `kv_index` False runs it without a prefix index;
    `first_token` "prefill" tells it a request's first token comes from prefill (as the fleet
    runs it, `pdplane.plan.fleetsim.FIRST_TOKEN_MODES`), as the gateway does.
    """

    tick_s = 0.05

    def __init__(
        self,
        profile: Profile,
        traffic: ChatTraffic,
        window: tuple[float, float],
        *,
        kv_index: bool = True,
        heartbeat_s: float = 1.0,
        seed: int = 0,
        first_token: str = "decode",
        **service: Any,
    ) -> None:
        super().__init__(traffic, window)
        self.profile = profile
        self._first_from_prefill = first_token == "prefill"
        self.clock = 0.0
        self._kv_index = kv_index
        self._heartbeat_s = heartbeat_s
        self._seed = seed
        self._service_options = service
        self.source = StaticSource()
        self.service: Decider | None = None
        self._ids: dict[str, tuple[str, int]] = {}
        self._nodes: list[tuple[str, int, EngineCore, instance_pb2.InstanceSpec]] = []
        self._due: list[float] = []
        self._last: list[tuple[int, int, float, int]] = []
        self._revision = 0

    def start(self, engines: FleetEngines) -> None:
        super().start(engines)
        p = self.profile
        for role, cores, code in (
            ("prefill", engines.prefill, instance_pb2.ROLE_PREFILL),
            ("decode", engines.decode, instance_pb2.ROLE_DECODE),
        ):
            for i, core in enumerate(cores):
                iid = f"{role[0]}{i:03d}"
                self._ids[iid] = (role, i)
                self._nodes.append((iid, i, core, _spec(iid, code, p)))
        n = len(self._nodes)
        # Each instance reports at its own phase of the heartbeat period.
        self._due = [self._heartbeat_s * k / n for k in range(n)]
        self._last = [(-1, -1, -1.0, -1)] * n
        for k in range(n):
            self._report(k)
        self.service = Decider(
            CandidateView(self.source),
            inflight=InflightTracker(clock=self._now),
            seed=self._seed,
            **self._service_options,
        )
        if self._kv_index:
            index = self.service.kv_index = PrefixIndex()
            for iid, _, core, _ in self._nodes:
                inst = index.add_instance(iid)
                index.set_state(inst, KvState.LIVE)
                core.pool.sink = _IndexSink(inst)

    def _now(self) -> float:
        return self.clock

    def _report(self, k: int) -> None:
        """Publishes instance k's load report when it changed (the registry's rule)."""
        _, _, core, spec = self._nodes[k]
        pool = core.pool
        load = (core.num_running, core.num_waiting, pool.usage, pool.num_free)
        if load == self._last[k]:
            return
        self._last[k] = load
        self._revision += 1
        self.source.put(
            instance_pb2.Instance(
                spec=spec,
                state=instance_pb2.INSTANCE_STATE_SERVING,
                load=instance_pb2.LoadReport(
                    num_running=load[0],
                    num_waiting=load[1],
                    kv_cache_usage=load[2],
                    free_kv_blocks=load[3],
                    total_kv_blocks=pool.num_blocks,
                ),
                revision=self._revision,
            )
        )

    def tick(self, now: float) -> None:
        self.clock = now
        due = self._due
        for k in range(len(due)):
            if due[k] <= now:
                due[k] += self._heartbeat_s
                self._report(k)

    def route(self, request: int, spec: RequestSpec, now: float) -> Routed | None:
        self.clock = now
        assert self.service is not None
        prompt = self.traffic.prompt(request)
        bs = self.profile.block_size
        features = RequestFeatures(
            str(request),
            MODEL,
            len(prompt),
            spec.output_tokens,
            prefix_hashes={bs: chain_hashes(prompt, bs)} if self._kv_index else {},
            # as the gateway asks: a request of one token takes the usual path
            first_token_from_prefill=self._first_from_prefill and spec.output_tokens > 1,
        )
        try:
            decision = self.service.schedule(features)
        except NoRoom:
            return None  # every decode is full now: ask again (`retry_s`)
        decode = self._ids[decision.decode.instance_id][1]
        prefill = None
        if decision.prefill is not None:
            prefill = self._ids[decision.prefill.instance_id][1]
        warm = None
        if decision.warm is not None:
            warm = (self._ids[decision.warm.instance.instance_id][1], decision.warm.prefix_tokens)
            self.stats.warms += 1
            self.stats.warm_tokens += decision.warm.prefix_tokens
        return Routed(prompt, self._outputs(request, spec), prefill, decode, warm)

    def released(self, request: int, now: float) -> None:
        self.clock = now
        assert self.service is not None
        self.service.release(str(request), Outcome.SUCCESS)


class OracleRouter(_Router):
    """The cache-knowing oracle (module doc)."""

    def __init__(self, profile: Profile, traffic: ChatTraffic, window: tuple[float, float]):
        super().__init__(traffic, window)
        self.block_size = profile.block_size
        self._prefill_tokens: list[int] = []
        self._decode_requests: list[int] = []
        self._legs: dict[int, tuple[int | None, int, int]] = {}

    def start(self, engines: FleetEngines) -> None:
        super().start(engines)
        self._prefill_tokens = [0] * len(engines.prefill)
        self._decode_requests = [0] * len(engines.decode)

    def route(self, request: int, spec: RequestSpec, now: float) -> Routed:
        prompt = self.traffic.prompt(request)
        outputs = self._outputs(request, spec)
        bs = self.block_size
        keys = chain_hashes(prompt, bs)
        most = (len(prompt) - 1) // bs
        best: tuple[int, int, int] | None = None
        for p, core in enumerate(self.engines.prefill):
            hit = len(core.pool.longest_hit(keys, most)) * bs
            cost = (self._prefill_tokens[p] + len(prompt) - hit, -hit, p)
            if best is None or cost < best:
                best = cost
        assert best is not None
        p = best[2]
        uncached = len(prompt) + best[1]
        d = min(
            range(len(self.engines.decode)),
            key=lambda d: (
                self._decode_requests[d],
                -len(self.engines.decode[d].pool.longest_hit(keys, most)),
                d,
            ),
        )
        self._prefill_tokens[p] += uncached
        self._decode_requests[d] += 1
        self._legs[request] = (p, d, uncached)
        return Routed(prompt, outputs, p, d)

    def prefill_done(self, request: int, prefill: EngineRequest, now: float) -> None:
        p, d, uncached = self._legs[request]
        if p is not None:
            self._prefill_tokens[p] -= uncached
        self._legs[request] = (None, d, 0)

    def released(self, request: int, now: float) -> None:
        _, d, _ = self._legs.pop(request)
        self._decode_requests[d] -= 1


@dataclass(slots=True)
class RoutedResult:
    """One routed run: the fleet's latencies and the router's window stats."""

    fleet: FleetResult
    stats: RouteStats
    extra: dict[str, float] = field(default_factory=dict)

    def numbers(self) -> dict[str, float]:
        """Flat numbers (ms, fractions, counts) for reports; `*_busy`: the fraction of the
        window a role's instances spent in steps (1.0: saturated)."""
        f, s = self.fleet, self.stats
        busy = {role: r.utilisation for role, r in f.roles.items()}
        return {
            "requests": float(f.requests),
            "ttft_p50_ms": f.ttft_q(0.5) * 1e3,
            "ttft_p90_ms": f.ttft_q(0.9) * 1e3,
            "ttft_p99_ms": f.ttft_q(0.99) * 1e3,
            "itl_p50_ms": f.itl_q(0.5) * 1e3,
            "itl_p99_ms": f.itl_q(0.99) * 1e3,
            # first token from prefill: the token 1 -> 2 gaps apart (0 when none)
            "handoff_p50_ms": f.handoff.quantile(0.5) * 1e3 if f.handoff.total else 0.0,
            "handoff_share": f.handoff.total / f.itl.total if f.itl.total else 0.0,
            "goodput_rps": f.goodput,
            "unfinished": float(f.unfinished),
            "fleet_hit": s.fleet_hit,
            "prefill_legs_per_request": s.prefill_legs_per_request,
            "decode_hit": s.decode_hit_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            "warms": float(s.warms),
            "warm_tokens": float(s.warm_tokens),
            "prefill_busy": busy.get("prefill", 0.0),
            "decode_busy": busy.get("decode", 0.0),
            **self.extra,
        }


def run_routed(
    profile: Profile,
    config: FleetConfig,
    traffic: ChatTraffic,
    router: str,
    *,
    warmup_s: float,
    ttft_slo_s: float = 2.0,
    itl_slo_s: float = 0.05,
    tail_s: float | None = None,
    seed: int = 0,
    first_token: str = "decode",
    **service: Any,
) -> RoutedResult:
    """One run of `traffic` on `config` routed by `router`: "oracle", or a policy name for
    both sides of a `SchedulerRouter` ("kv_aware", "least_loaded", ...) with the shipped
    defaults of `pdplane scheduler`'s flags (`decision_options(PolicySettings())`), which
    `service` keyword arguments of `Decider` override, and kv_aware predicting with
    `profile`. Load-only policies run without a prefix index. `first_token`: where the
    client's first token comes from (`pdplane.plan.fleetsim.FIRST_TOKEN_MODES`)."""
    end = max((r.at for r in traffic.requests), default=0.0)
    window = (min(warmup_s, end), end)
    routed: _Router
    if router == "oracle":
        routed = OracleRouter(profile, traffic, window)
    else:
        # kv_aware predicts with the fleet's own profile (as a deployment configures it).
        options = {**decision_options(PolicySettings()), "kv_profile": profile, **service}
        routed = SchedulerRouter(
            profile,
            traffic,
            window,
            kv_index=router == "kv_aware",
            seed=seed,
            first_token=first_token,
            prefill_policy=router,
            decode_policy=router,
            **options,
        )
    fleet = simulate_fleet(
        profile,
        traffic.requests,
        config,
        ttft_slo_s=ttft_slo_s,
        itl_slo_s=itl_slo_s,
        warmup_s=warmup_s,
        tail_s=tail_s,
        router=routed,
        first_token=first_token,
    )
    return RoutedResult(fleet, routed.stats)
