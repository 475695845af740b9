"""Everything one simulated instance knows, without any network I/O (handlers share it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdplane.core.layout import fingerprint
from pdplane.sim.config import SimConfig
from pdplane.sim.engine import EngineState
from pdplane.sim.faults import FaultPlan
from pdplane.sim.metrics import SimMetrics
from pdplane.sim.records import Recorder
from pdplane.sim.transfers import KvPeers, TransferTable
from pdplane.v1 import instance_pb2

__all__ = ["SimState"]


@dataclass
class SimState:
    """Engine, KV transfers, records, faults and metrics of one sim.

    `instance_id`, `url` and `kv_endpoint` are filled in once the ports are bound.
    """

    config: SimConfig
    engine: EngineState = field(init=False)
    transfers: TransferTable = field(init=False)
    peers: KvPeers = field(init=False)
    recorder: Recorder = field(init=False)
    faults: FaultPlan = field(init=False)
    metrics: SimMetrics = field(init=False)
    instance_id: str = ""
    url: str = ""
    kv_endpoint: str = ""

    def __post_init__(self) -> None:
        c = self.config
        self.engine = EngineState(
            max_running=c.max_running, kv_blocks=c.kv_blocks, block_size=c.block_size
        )
        self.transfers = TransferTable(self.engine, c.kv_hold_timeout_s)
        self.peers = KvPeers()
        self.recorder = Recorder(c.record_limit)
        self.faults = FaultPlan(
            failure_rate=c.failure_rate,
            fail_mode=c.fail_mode,
            fail_after_tokens=c.fail_after_tokens,
            seed=c.seed,
        )
        self.metrics = SimMetrics(self.engine, c.model)

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

    def load_report(self) -> instance_pb2.LoadReport:
        """The heartbeat's load: derived from the sim's queues and KV blocks."""
        e = self.engine
        return instance_pb2.LoadReport(
            num_running=e.num_running,
            num_waiting=e.num_waiting,
            kv_cache_usage=e.kv_usage,
            free_kv_blocks=e.free_blocks,
            total_kv_blocks=e.total_blocks,
            inflight_transfers=e.held_transfers + e.pulling,
            recv_buffer_headroom_bytes=0,
        )
