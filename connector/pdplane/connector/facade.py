"""`PdPlaneConnector`: the class vLLM loads (`kv_connector_module_path: "pdplane.connector"`).

A thin role facade: the scheduler-role object delegates to `SchedulerSide` (and registers the
instance), the worker-role object to `WorkerSide`. Hook signatures accept extra keyword
arguments so that the same class loads on vLLM 0.26 .. 0.33.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from pdplane.connector.config import ConnectorConfig
from pdplane.connector.kv_events import reader_endpoint
from pdplane.connector.lifeline import watch_parent
from pdplane.connector.logs import setup_connector_logging
from pdplane.connector.metadata import PdPlaneConnectorMetadata
from pdplane.connector.registration import InstanceRegistration, build_spec
from pdplane.connector.scheduler_side import SchedulerSide
from pdplane.connector.stats import PdPlaneKvStats, PdPlanePromMetrics
from pdplane.connector.tokenizer import published_tokenizer
from pdplane.connector.vllm_info import (
    ROLES,
    data_parallel_rank,
    kv_layout,
    served_model_name,
    software_version,
    tp_rank,
)
from pdplane.connector.worker_side import WorkerSide
from pdplane.core import tracing
from pdplane.v1 import instance_pb2

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

__all__ = ["PdPlaneConnector"]

log = logging.getLogger(__name__)

try:  # vLLM >= 0.32 labels externally loaded prompt tokens by source
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _P2P_SOURCE: Any = CacheHitSource.P2P
except ImportError:  # older vLLM: no per-source metrics
    _P2P_SOURCE = None


class PdPlaneConnector(KVConnectorBase_V1):
    """pdplane's P/D connector: pull (default) or push mode (see docs/connector.md)."""

    if _P2P_SOURCE is not None:
        _cache_hit_source = _P2P_SOURCE

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """False: vLLM (>= 0.33) then refuses `--enable-sleep-mode` with this connector at
        startup. Sleep discards the KV cache under prefill's held blocks and decode's pushed
        transfers, and pdplane does not yet drop those (and deregister) around sleep/wake."""
        return False

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: Any | None = None,
        **kwargs: Any,
    ) -> None:
        setup_connector_logging()
        tracing.configure("pdplane-connector")
        try:
            super().__init__(
                vllm_config=vllm_config,
                role=role,
                kv_cache_config=kv_cache_config,  # type: ignore[arg-type]
            )
        except TypeError:  # vLLM versions without kv_cache_config
            super().__init__(vllm_config=vllm_config, role=role)  # type: ignore[call-arg]
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            # Block ids are per group; a transfer carries one block list.
            raise ValueError(
                f"PdPlaneConnector supports models with one KV cache group, got {len(groups)}"
            )
        transfer_config = vllm_config.kv_transfer_config
        self.config = ConnectorConfig.from_extra_config(
            getattr(transfer_config, "kv_connector_extra_config", None)
        )
        self.kv_role = str(getattr(transfer_config, "kv_role", "kv_both"))
        self.instance_id = self.config.resolved_instance_id()
        self.layout = kv_layout(vllm_config, kv_cache_config)
        self.tp_size = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1))
        self._num_blocks = getattr(kv_cache_config, "num_blocks", None)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._registration: InstanceRegistration | None = None
        self._cache_manager: Any = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                self.config, self.instance_id, self.layout, self.tp_size
            )
            self._start_registration(vllm_config)
        else:
            events_config = getattr(vllm_config, "kv_events_config", None)
            self._worker = WorkerSide(
                self.config,
                self.layout,
                self.instance_id,
                tp_rank(),
                self._num_blocks,
                kv_events_endpoint=reader_endpoint(events_config, data_parallel_rank(vllm_config)),
                kv_events_topic=str(getattr(events_config, "topic", "") or ""),
                role=self.kv_role,
                model=served_model_name(vllm_config),
                tp_size=self.tp_size,
                tokenizer=published_tokenizer(vllm_config) if tp_rank() == 0 else None,
            )
        # No engine process outlives its API server (an orphan would keep the KV port and
        # heartbeat for a dead HTTP server); deregistering first tells the gateway at once.
        watch_parent(self._registration.stop if self._registration is not None else None)

    def _start_registration(self, vllm_config: VllmConfig) -> None:
        if not self.config.registry:
            return
        spec = build_spec(
            self.config,
            self.instance_id,
            ROLES.get(self.kv_role, instance_pb2.ROLE_BOTH),
            served_model_name(vllm_config),
            self.layout,
            int(vllm_config.model_config.max_model_len),
            self.tp_size,
            software_version(),
            tokenizer_hash=getattr(published_tokenizer(vllm_config), "content_hash", ""),
        )
        self._registration = InstanceRegistration(self.config, spec, self._load)
        self._registration.start()

    def _load(self) -> instance_pb2.LoadReport:
        assert self._scheduler is not None
        return self._scheduler.load(self._cache_manager, int(self._num_blocks or 0))

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, PdPlaneConnectorMetadata):
            self._worker.handle_metadata(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Pulls run in the background (started when the metadata is bound)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loads are asynchronous and complete before scheduling."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Push mode: sends the layer's blocks of this step's pushed prompts to decode.
        Pull mode saves nothing: prefill keeps the blocks in place until decode pulls."""
        if self._worker is not None:
            self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        """Push mode: closes this step's push streams (bytes still travel in the
        background; prefill holds the blocks until decode completes the transfer)."""
        if self._worker is not None:
            self._worker.wait_for_save()

    def get_finished(
        self, finished_req_ids: set[str], *args: Any, **kwargs: Any
    ) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker else set()

    def get_kv_connector_stats(self) -> PdPlaneKvStats | None:
        """Worker: gauges and counters that changed since the last step (see stats.py); they
        reach the scheduler side (load report) and vLLM's loggers."""
        return self._worker.stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PdPlaneKvStats:
        return PdPlaneKvStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PdPlanePromMetrics:
        return PdPlanePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- scheduler side ------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._cache_manager = kv_cache_manager
        parent = getattr(super(), "bind_kv_cache_manager", None)
        if parent is not None:
            parent(kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    # -- both ----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._registration is not None:
            self._registration.stop()
        if self._worker is not None:
            self._worker.shutdown()
