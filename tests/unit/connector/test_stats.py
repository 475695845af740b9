"""What workers report each engine step (stats.py) and how it reaches the load report."""

from __future__ import annotations

import torch

from pdplane.connector.config import ConnectorConfig
from pdplane.connector.facade import PdPlaneConnector
from pdplane.connector.scheduler_side import SchedulerSide
from pdplane.connector.stats import PdPlaneKvStats, rank_stats
from pdplane.connector.worker_side import WorkerSide
from pdplane.v1 import instance_pb2

SHAPE = (16, 2, 4, 16)  # 512 bytes per block and layer (float32)
LAYOUT = instance_pb2.KvLayout(
    num_layers=2, num_kv_heads=2, head_size=8, block_size=4, dtype="float32"
)


def _push_worker(buffer_bytes: int = 1 << 20) -> WorkerSide:
    config = ConnectorConfig.model_validate({"mode": "push", "push_buffer_bytes": buffer_bytes})
    side = WorkerSide(config, LAYOUT, instance_id="d", num_blocks=SHAPE[0])
    side.register_kv_caches(
        {f"model.layers.{i}.self_attn.attn": torch.zeros(SHAPE) for i in (0, 1)}
    )
    return side


class _Output:
    def __init__(self, stats: PdPlaneKvStats | None) -> None:
        self.kv_connector_stats = stats
        self.finished_sending = self.finished_recving = None


def test_a_push_worker_reports_its_buffer_once_until_it_changes() -> None:
    side = _push_worker()
    try:
        first = side.stats()
        assert first is not None
        gauges = first.rank_gauges()[0]
        assert gauges["push_capacity_bytes"] == gauges["push_headroom_bytes"] == 1 << 20
        assert gauges["kv_block_bytes"] == 2 * 512
        assert side.stats() is None  # nothing changed: nothing to send this step
        buffer = side.transport.receive_buffer
        assert buffer is not None
        buffer.reserve("t1", "p", 4, [512, 512])  # type: ignore[attr-defined]
        again = side.stats()
        assert again is not None
        assert again.rank_gauges()[0]["push_headroom_bytes"] == (1 << 20) - 4 * 1024
    finally:
        side.shutdown()


def test_a_pull_worker_reports_no_buffer() -> None:
    config = ConnectorConfig()
    side = WorkerSide(config, LAYOUT, instance_id="d", num_blocks=SHAPE[0])
    side.register_kv_caches({"l0": torch.zeros(SHAPE)})
    try:
        stats = side.stats()
        assert stats is not None and "push_capacity_bytes" not in stats.rank_gauges()[0]
    finally:
        side.shutdown()


def test_counters_are_sent_as_increments_and_summed_over_ranks() -> None:
    side = _push_worker()
    try:
        side.stats()
        side.peers_gone += 2
        stats = side.stats()
        assert stats is not None and stats.data["counters"] == {"peers_gone": 2}
        assert side.stats() is None
    finally:
        side.shutdown()
    a = rank_stats(0, {"push_headroom_bytes": 5, "push_capacity_bytes": 9}, {"peers_gone": 1})
    b = rank_stats(1, {"push_headroom_bytes": 3, "push_capacity_bytes": 9}, {"peers_gone": 2})
    both = a.aggregate(b)
    assert both.data["counters"] == {"peers_gone": 3}
    assert both.reduce()["push_headroom_mib"] == 0.0 and both.reduce()["peers_gone"] == 3
    assert a.data["counters"] == {"peers_gone": 1}  # inputs untouched
    assert PdPlaneConnector.build_kv_connector_stats(both.data).rank_gauges() == {
        0: {"push_headroom_bytes": 5, "push_capacity_bytes": 9},
        1: {"push_headroom_bytes": 3, "push_capacity_bytes": 9},
    }


def test_the_load_report_takes_the_smallest_headroom_once_every_rank_reported() -> None:
    config = ConnectorConfig.model_validate({"mode": "push"})
    side = SchedulerSide(config, "d", LAYOUT, tp_size=2)
    rank0 = {"push_capacity_bytes": 100, "push_headroom_bytes": 70, "kv_block_bytes": 8}
    side.update_connector_output(_Output(rank_stats(0, rank0)))
    report = side.load(None, 16)
    assert report.recv_buffer_capacity_bytes == 0  # rank 1 unheard of: no claim of room
    assert report.kv_block_bytes == 8
    rank1 = {**rank0, "push_headroom_bytes": 40}
    side.update_connector_output(_Output(rank_stats(1, rank1)))
    report = side.load(None, 16)
    assert report.recv_buffer_capacity_bytes == 100
    assert report.recv_buffer_headroom_bytes == 40
    side.update_connector_output(_Output(None))  # a step without stats keeps the last values
    assert side.load(None, 16).recv_buffer_headroom_bytes == 40
