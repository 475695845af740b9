"""What the workers tell the scheduler side and vLLM's metrics: per-rank gauges and counters.

Each worker (TP rank) returns a `PdPlaneKvStats` from `get_kv_connector_stats()` on an engine
step when something changed: its push receive buffer (capacity and headroom, bytes), the bytes
of one KV cache block over all layers, its peer connections, and counters of events since its
last report (peers that left, communicators evicted). vLLM carries them to the scheduler side
(`update_connector_output`: the heartbeat's load report takes the receive-buffer headroom from
there) and on to its loggers (the periodic "KV Transfer metrics" line, and Prometheus through
`PdPlanePromMetrics`). Only plain dicts of str -> int travel (vLLM serialises them between
processes).

Data layout: `{"ranks": {"<tp rank>": {gauge: int}}, "counters": {name: int}}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

__all__ = ["COUNTERS", "GAUGES", "PdPlaneKvStats", "PdPlanePromMetrics", "rank_stats"]

#: per-rank gauges (latest value wins): bytes, or a count
GAUGES = (
    "push_capacity_bytes",
    "push_headroom_bytes",
    "kv_block_bytes",
    "peer_channels",
    "communicators",
)
#: counters (events since the previous report; summed)
COUNTERS = (
    "peers_gone",
    "communicators_created",
    "communicators_evicted",
    "communicators_dropped",
    "communicators_failed",
)


def rank_stats(
    tp_rank: int, gauges: dict[str, int], counters: dict[str, int] | None = None
) -> PdPlaneKvStats:
    """One worker's report: `gauges` (names of GAUGES) and `counters` (names of COUNTERS)."""
    return PdPlaneKvStats(
        data={
            "ranks": {str(tp_rank): {k: int(v) for k, v in gauges.items() if k in GAUGES}},
            "counters": {k: int(v) for k, v in (counters or {}).items() if k in COUNTERS and v},
        }
    )


@dataclass
class PdPlaneKvStats(KVConnectorStats):
    """The connector's stats; `data` as in the module docstring."""

    def __post_init__(self) -> None:
        self.data.setdefault("ranks", {})
        self.data.setdefault("counters", {})

    def reset(self) -> None:
        self.data = {"ranks": {}, "counters": {}}

    def aggregate(self, other: KVConnectorStats) -> PdPlaneKvStats:
        """Ranks merged (`other`'s values are newer), counters summed. Returns a new object;
        neither input is changed (vLLM may still hold them)."""
        ranks = {r: dict(g) for r, g in self.data.get("ranks", {}).items()}
        counters = dict(self.data.get("counters", {}))
        for rank, gauges in (other.data.get("ranks") or {}).items():
            ranks.setdefault(rank, {}).update(gauges)
        for name, n in (other.data.get("counters") or {}).items():
            counters[name] = counters.get(name, 0) + int(n)
        return PdPlaneKvStats(data={"ranks": ranks, "counters": counters})

    def reduce(self) -> dict[str, int | float]:
        """One line's worth for vLLM's periodic log: the smallest headroom over the ranks
        (MiB), communicators in all ranks, and the counters."""
        ranks = self.data.get("ranks", {}).values()
        out: dict[str, int | float] = {}
        headroom = [g["push_headroom_bytes"] for g in ranks if g.get("push_capacity_bytes")]
        if headroom:
            out["push_headroom_mib"] = round(min(headroom) / 2**20, 1)
        if any("communicators" in g for g in ranks):
            out["communicators"] = sum(g.get("communicators", 0) for g in ranks)
        out.update(self.data.get("counters", {}))
        return out

    def is_empty(self) -> bool:
        return not self.data.get("ranks") and not self.data.get("counters")

    def rank_gauges(self) -> dict[int, dict[str, int]]:
        """{tp rank: gauges} as reported."""
        return {int(r): dict(g) for r, g in self.data.get("ranks", {}).items()}


class PdPlanePromMetrics(KVConnectorPromMetrics):
    """Prometheus series of the connector's stats, per engine (vLLM's labels):
    `pdplane:kv_push_headroom_bytes` (smallest over the ranks), `pdplane:kv_communicators`
    (all ranks), and one `pdplane:kv_<counter>_total` per counter."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)  # type: ignore[arg-type]
        gauge: Any = self._gauge_cls
        counter: Any = self._counter_cls
        self._headroom = gauge(
            name="pdplane:kv_push_headroom_bytes",
            documentation="Largest pushed transfer the receive buffer takes now (bytes).",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        self._communicators = gauge(
            name="pdplane:kv_communicators",
            documentation="NCCL communicators with peers, over the TP ranks.",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        self._counters = {
            name: counter(
                name=f"pdplane:kv_{name}",
                documentation=f"{name.replace('_', ' ').capitalize()} (count).",
                labelnames=labelnames,
            )
            for name in COUNTERS
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues.get(engine_idx, [])
        ranks = (transfer_stats_data.get("ranks") or {}).values()
        headroom = [g["push_headroom_bytes"] for g in ranks if g.get("push_capacity_bytes")]
        if headroom:
            self._headroom.labels(*labels).set(min(headroom))
        if any("communicators" in g for g in ranks):
            self._communicators.labels(*labels).set(sum(g.get("communicators", 0) for g in ranks))
        for name, n in (transfer_stats_data.get("counters") or {}).items():
            if name in self._counters and n:
                self._counters[name].labels(*labels).inc(n)
