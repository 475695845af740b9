"""Everything one simulated instance knows, without any network I/O (handlers share it)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdplane.core.instance.layout import fingerprint
from pdplane.core.kv_events.log import KvEventLog
from pdplane.sim.config import SimConfig
from pdplane.sim.engine import EngineCore, EngineLimits
from pdplane.sim.faults import FaultPlan
from pdplane.sim.frontend import Frontend
from pdplane.sim.kv_cache import BlockPool
from pdplane.sim.metrics import SimMetrics
from pdplane.sim.push import Pusher, ReceiveBuffer
from pdplane.sim.records import Recorder
from pdplane.sim.runner import EngineRunner
from pdplane.sim.tokens import Tokenizer, load_tokenizer
from pdplane.sim.transfers import KvPeers, TransferTable
from pdplane.v1 import instance_pb2

__all__ = ["SimState"]


@dataclass
class SimState:
    """Engine, KV transfers, records, faults and metrics of one sim.

    `instance_id`, `url` and `kv_endpoint` are filled in once the ports are bound; the runner
    steps only after `runner.start()` (on the serving loop). `tokenizer` may be shared by all
    sims of a process (pass it in; loading one costs time and memory).
    """

    config: SimConfig
    tokenizer: Tokenizer | None = None
    core: EngineCore = field(init=False)
    events: KvEventLog | None = field(init=False)
    runner: EngineRunner = field(init=False)
    frontend: Frontend = field(init=False)
    transfers: TransferTable = field(init=False)
    peers: KvPeers = field(init=False)
    push_buffer: ReceiveBuffer | None = field(init=False)
    pusher: Pusher = field(init=False)
    recorder: Recorder = field(init=False)
    faults: FaultPlan = field(init=False)
    metrics: SimMetrics = field(init=False)
    instance_id: str = ""
    url: str = ""
    kv_endpoint: str = ""
    #: Kills the instance (`FaultPlan.kill_after_tokens`); set by the instance that serves it.
    kill: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        c = self.config
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(c.tokenizer or None)
        limits = EngineLimits(
            num_blocks=c.kv_blocks,
            block_size=c.block_size,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            prefix_caching=c.prefix_caching,
            stream_interval=c.stream_interval,
        )
        self.events = KvEventLog() if c.kv_events else None
        pool = BlockPool(c.kv_blocks, c.block_size, caching=c.prefix_caching, sink=self.events)
        self.core = EngineCore(limits, c.cost_model(), pool)
        self.runner = EngineRunner(self.core, time_scale=c.time_scale)
        self.frontend = Frontend(self.core.cost)  # on the runner's clock (modelled s)
        self.transfers = TransferTable(self.runner.release, c.kv_hold_timeout_s)
        self.peers = KvPeers(token=c.kv_token or None)
        self.push_buffer = ReceiveBuffer(c.push_buffer_bytes) if c.kv_mode == "push" else None
        self.pusher = Pusher(self.peers.tcp_stub)
        self.recorder = Recorder(c.record_limit)
        self.faults = FaultPlan(
            failure_rate=c.failure_rate,
            fail_mode=c.fail_mode,
            fail_after_tokens=c.fail_after_tokens,
            seed=c.seed,
        )
        self.metrics = SimMetrics(lambda: self.core, c.model)

    @property
    def kv_layout(self) -> instance_pb2.KvLayout:
        c = self.config
        return instance_pb2.KvLayout(
            num_layers=c.num_layers,
            num_kv_heads=c.num_kv_heads,
            head_size=c.head_size,
            block_size=c.block_size,
            dtype=c.kv_dtype,
        )

    @property
    def layout_fingerprint(self) -> str:
        return fingerprint(self.kv_layout)

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV cache block (all layers)."""
        return self.config.kv_bytes_per_token * self.config.block_size

    def stats_snapshot(self) -> dict[str, Any]:
        """The body of `GET /sim/stats`: engine counters up to now (modelled s), the push
        buffer's and pusher's counters, the wall clock (Unix s)."""
        core = self.core
        core.sample(self.runner.now())
        buffer = self.push_buffer
        out = core.stats.to_dict()
        out.update(
            wall_time=time.time(),
            num_running=core.num_running,
            num_waiting=core.num_waiting,
            kv_cache_usage=core.pool.usage,
            cached_blocks=len(core.pool.cached),
            evictions=core.pool.evictions,
            held_transfers=len(self.transfers.held),
            push_accepted=buffer.accepted if buffer else 0,
            push_buffer_refused=buffer.refused if buffer else 0,
            push_buffer_used_bytes=buffer.used_bytes if buffer else 0,
            pushes_sent=self.pusher.pushed,
            pushes_refused=self.pusher.refused,
            time_scale=self.config.time_scale,
        )
        return out

    def reset_peaks(self) -> None:
        """Max running / waiting / KV usage restart from their current values."""
        core, st = self.core, self.core.stats
        st.max_running, st.max_waiting = core.num_running, core.num_waiting
        st.max_kv_usage = core.pool.usage

    def load_report(self) -> instance_pb2.LoadReport:
        """The heartbeat's load: derived from the engine's queues and KV blocks."""
        core = self.core
        buffer = self.push_buffer
        return instance_pb2.LoadReport(
            num_running=core.num_running,
            num_waiting=core.num_waiting,
            kv_cache_usage=core.pool.usage,
            free_kv_blocks=core.pool.num_free,
            total_kv_blocks=core.pool.num_blocks,
            inflight_transfers=len(self.transfers.held) + len(core.loading),
            recv_buffer_headroom_bytes=buffer.headroom_bytes if buffer is not None else 0,
        )
