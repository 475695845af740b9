"""Scheduler-side half of the connector: decides, per request, what to hold or pull.

Lives in vLLM's engine-core process next to the scheduler (one per instance). It reads only
`kv_transfer_params` (never request ids) and hands its decisions to the workers through the
step's metadata:

* prefill (`do_remote_decode`): when the request finishes normally, keep its prompt blocks
  (`request_finished` returns True) under the transfer id the gateway chose, else one derived
  from the gateway's request id plus a random part, and return the `DecodeRequestParams` for
  the decode leg;
* decode (`do_remote_prefill`): report the prompt tokens beyond the local prefix cache as
  loadable asynchronously, and once vLLM allocated blocks for them, ask the workers to pull
  exactly those blocks; if nothing needs pulling (or the request ends before its load),
  ask the workers to tell prefill to free the transfer;
* push mode (`mode: "push"`), prefill: when a step computes a prompt whose
  `kv_transfer_params` name the decode instance, issue the transfer id at once and ask the
  workers to push the prompt's blocks there during that step's forward (`PushSpec`); the
  hold and the returned params are as above, plus `pushed: true`. A prompt split over several
  steps (chunked prefill) is not pushed: decode pulls it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pdplane.connector.config import ConnectorConfig
from pdplane.connector.metadata import (
    HoldSpec,
    LoadSpec,
    PdPlaneConnectorMetadata,
    PushSpec,
    ReleaseSpec,
)
from pdplane.connector.stats import PdPlaneKvStats
from pdplane.core.instance.layout import fingerprint
from pdplane.core.kv_params import (
    DecodeRequestParams,
    KvParamsError,
    PrefillRequestParams,
    make_transfer_id,
    prompt_fingerprint,
)
from pdplane.v1 import instance_pb2

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

log = logging.getLogger(__name__)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class SchedulerSide:
    """Per-instance transfer decisions and load accounting.

    Args:
        config: the connector settings.
        engine_id: this instance's registry id (goes into the params prefill returns).
        layout: this instance's KV layout (per TP rank).
        tp_size: this instance's tensor-parallel size.
    """

    def __init__(
        self,
        config: ConnectorConfig,
        engine_id: str,
        layout: instance_pb2.KvLayout,
        tp_size: int = 1,
    ) -> None:
        self.config = config
        self.tp_size = tp_size
        self.engine_id = engine_id
        self.layout = layout
        self.fingerprint = fingerprint(layout)
        self.block_size = int(layout.block_size)
        self._lock = threading.Lock()  # guards the counters read by the heartbeat thread
        # decode: requests whose params were consumed (pull or release decided)
        self._consumed: set[str] = set()
        # decode: req id -> (params, num_external_tokens, num_local_tokens) awaiting allocation
        self._pending: dict[str, tuple[DecodeRequestParams, int, int]] = {}
        self._seq = 0
        self._meta = PdPlaneConnectorMetadata()
        self._live: set[str] = set()  # requests in the engine (waiting or running)
        self._num_running = 0
        self._sending: set[str] = set()  # prefill holds not yet reported finished
        self._receiving: dict[str, str] = {}  # decode req id -> transfer id, load unreported
        # prefill, push mode: req id -> (transfer id, decode endpoint, decode id) allocated
        # this step
        self._push_candidates: dict[str, tuple[str, str, str]] = {}
        # prefill: req id -> (transfer id, pushed) issued before the request finished
        self._issued: dict[str, tuple[str, bool]] = {}
        # TP rank -> the worker's latest gauges (stats.GAUGES), from update_connector_output
        self._rank_gauges: dict[int, dict[str, int]] = {}

    # -- vLLM scheduler hooks ------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        with self._lock:
            self._live.add(request.request_id)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens decode will load from prefill beyond `num_computed_tokens` (local prefix
        hits), loaded asynchronously. Side-effect free apart from remembering the answer."""
        with self._lock:
            self._live.add(request.request_id)
        params = self._decode_params(request)
        if params is None:
            return 0, False
        problem = self._check(params, request.prompt_token_ids or ())
        if problem:
            log.warning("transfer %s: computing locally: %s", params.transfer_id, problem)
            self._pending[request.request_id] = (params, 0, num_computed_tokens)
            return 0, False
        count = params.num_tokens - num_computed_tokens
        self._pending[request.request_id] = (params, max(count, 0), num_computed_tokens)
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Turns the pending decision into a pull of the allocated blocks (or a release)."""
        req_id = request.request_id
        if self.config.mode == "push" and req_id not in self._issued:
            self._note_push_candidate(request)
        pending = self._pending.pop(req_id, None)
        if pending is None or req_id in self._consumed:
            return
        params, _, num_local = pending
        self._consumed.add(req_id)
        if num_external_tokens <= 0:
            self._meta.releases.append(
                ReleaseSpec(params.transfer_id, params.kv_endpoint, "decode needs no blocks")
            )
            return
        first = num_local // self.block_size
        last = _ceil_div(num_local + num_external_tokens, self.block_size)
        local_ids = list(blocks.get_block_ids()[0])[first:last]
        if len(local_ids) != last - first or last > len(params.block_ids):
            log.error("transfer %s: allocation does not cover the prompt", params.transfer_id)
            self._meta.releases.append(
                ReleaseSpec(params.transfer_id, params.kv_endpoint, "decode allocation mismatch")
            )
            return
        self._meta.loads.append(
            LoadSpec(
                req_id=req_id,
                transfer_id=params.transfer_id,
                endpoint=params.kv_endpoint,
                remote_block_indices=tuple(range(first, last)),
                local_block_ids=tuple(local_ids),
                num_tokens=num_external_tokens,
                pushed=params.pushed,
                sender_id=params.engine_id,
                traceparent=params.traceparent,
            )
        )
        with self._lock:
            self._receiving[req_id] = params.transfer_id
        log.info(
            "transfer %s: loading %d blocks (%d tokens) from %s%s",
            params.transfer_id,
            last - first,
            num_external_tokens,
            params.kv_endpoint,
            " (pushed)" if params.pushed else "",
        )

    def build_connector_meta(self, scheduler_output: Any) -> PdPlaneConnectorMetadata:
        """This step's holds/loads/releases; the returned object is never touched again."""
        if self._push_candidates:
            self._plan_pushes(scheduler_output)
        self._seq += 1
        meta, self._meta = self._meta, PdPlaneConnectorMetadata()
        meta.seq = self._seq
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        with self._lock:
            self._num_running = len(scheduled)
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Prefill: hold the prompt blocks and return the decode params. Decode: if the load
        never started, tell prefill to free the transfer."""
        req_id = request.request_id
        with self._lock:
            self._live.discard(req_id)
        self._pending.pop(req_id, None)
        self._push_candidates.pop(req_id, None)
        issued = self._issued.pop(req_id, None)
        consumed = req_id in self._consumed
        self._consumed.discard(req_id)
        params = request.kv_transfer_params or {}
        log.debug("request_finished %s status=%s consumed=%s", req_id, request.status, consumed)
        if params.get("do_remote_prefill") and not consumed:
            try:
                dp = DecodeRequestParams.from_dict(params)
            except KvParamsError:
                return False, None
            with self._lock:
                # vLLM may finish a second Request carrying the same params (seen on abort:
                # one per internal id); never release a transfer another request is pulling.
                in_use = dp.transfer_id in self._receiving.values()
            if in_use:
                return False, None
            self._meta.releases.append(
                ReleaseSpec(dp.transfer_id, dp.kv_endpoint, "decode request ended before load")
            )
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        return self._hold(request, block_ids, params, issued)

    def update_connector_output(self, output: Any) -> None:
        """Forgets transfers the workers reported finished (for the in-flight count) and keeps
        the workers' latest gauges (for the load report)."""
        stats = getattr(output, "kv_connector_stats", None)
        with self._lock:
            self._sending.difference_update(getattr(output, "finished_sending", None) or ())
            for req_id in getattr(output, "finished_recving", None) or ():
                self._receiving.pop(req_id, None)
            if isinstance(stats, PdPlaneKvStats):
                for rank, gauges in stats.rank_gauges().items():
                    self._rank_gauges.setdefault(rank, {}).update(gauges)

    # -- load report ---------------------------------------------------------------------------

    def load(self, kv_cache_manager: Any, total_blocks: int) -> instance_pb2.LoadReport:
        """The heartbeat's load report (called from the registration thread). The push
        receive buffer's capacity and headroom are the smallest over the TP ranks that
        reported them (0 until every rank did: a partial view would overstate the room)."""
        with self._lock:
            running = self._num_running
            live = len(self._live)
            inflight = len(self._sending) + len(self._receiving)
            ranks = [dict(g) for g in self._rank_gauges.values()]
        report = instance_pb2.LoadReport(
            num_running=running,
            num_waiting=max(live - running, 0),
            inflight_transfers=inflight,
            total_kv_blocks=total_blocks,
        )
        if ranks:
            report.kv_block_bytes = max(g.get("kv_block_bytes", 0) for g in ranks)
        if len(ranks) == self.tp_size and all(g.get("push_capacity_bytes") for g in ranks):
            report.recv_buffer_capacity_bytes = min(g["push_capacity_bytes"] for g in ranks)
            report.recv_buffer_headroom_bytes = min(g["push_headroom_bytes"] for g in ranks)
        pool = getattr(kv_cache_manager, "block_pool", None)
        if pool is not None:
            report.free_kv_blocks = int(pool.get_num_free_blocks())
            report.kv_cache_usage = float(pool.get_usage())
        else:
            # vLLM versions that never bind the cache manager: report "all free" rather than a
            # zero that would make the decode-side guard skip this instance forever.
            report.free_kv_blocks = total_blocks
        return report

    # -- helpers -------------------------------------------------------------------------------

    def _decode_params(self, request: Request) -> DecodeRequestParams | None:
        req_id = request.request_id
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or req_id in self._consumed:
            return None
        try:
            return DecodeRequestParams.from_dict(params)
        except KvParamsError as exc:
            log.warning("request %s: ignoring kv_transfer_params: %s", req_id, exc)
            return None

    def _check(self, params: DecodeRequestParams, prompt: Sequence[int]) -> str:
        prompt_len = len(prompt)
        if params.kv_layout != self.fingerprint:
            return f"KV layout {params.kv_layout} != ours {self.fingerprint}"
        if params.transport != self.config.transport:
            return f"transport {params.transport} != ours {self.config.transport}"
        if params.tp_size != self.tp_size:
            return f"prefill TP size {params.tp_size} != ours {self.tp_size}"
        # One token more: the gateway streamed prefill's first output token to the client
        # and appended it to decode's prompt; decode loads prefill's tokens and computes that
        # one itself (its first step then yields the second output token).
        if prompt_len not in (params.num_tokens, params.num_tokens + 1):
            return f"prefill computed {params.num_tokens} tokens, prompt has {prompt_len}"
        if len(params.block_ids) < _ceil_div(params.num_tokens, self.block_size):
            return f"{len(params.block_ids)} blocks cannot hold {params.num_tokens} tokens"
        computed = prompt[: params.num_tokens]
        if params.prompt_hash and params.prompt_hash != prompt_fingerprint(computed):
            return "the prompt differs from the one prefill computed"
        return ""

    def _note_push_candidate(self, request: Request) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return
        try:
            pp = PrefillRequestParams.from_dict(params)
        except KvParamsError:
            return  # _hold logs it when the request finishes
        if pp.decode_kv_endpoint:
            tid = pp.transfer_id or make_transfer_id(pp.request_id)
            self._push_candidates[request.request_id] = (
                tid,
                pp.decode_kv_endpoint,
                pp.decode_engine_id or "",
            )

    def _plan_pushes(self, scheduler_output: Any) -> None:
        """Push the candidates whose whole prompt this step computes; forget the others."""
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            cand = self._push_candidates.get(new.req_id)
            if cand is None:
                continue
            tid, endpoint, decode_id = cand
            prompt_len = len(new.prompt_token_ids or ())
            done = int(new.num_computed_tokens) + int(scheduled.get(new.req_id, 0))
            ids = list(new.block_ids[0]) if new.block_ids else []
            needed = _ceil_div(prompt_len, self.block_size)
            if prompt_len == 0 or done < prompt_len or len(ids) < needed:
                log.info("transfer %s: prompt not computed in one step; decode pulls", tid)
                self._issued[new.req_id] = (tid, False)
                continue
            self._issued[new.req_id] = (tid, True)
            self._meta.pushes.append(
                PushSpec(new.req_id, tid, endpoint, tuple(ids[:needed]), decode_id)
            )
            log.info("transfer %s: pushing %d blocks to %s", tid, needed, endpoint)
        self._push_candidates.clear()

    def _hold(
        self,
        request: Request,
        block_ids: list[int],
        params: dict[str, Any],
        issued: tuple[str, bool] | None = None,
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        try:
            pp = PrefillRequestParams.from_dict(params)
        except KvParamsError as exc:
            log.warning("request %s: not holding KV: %s", request.request_id, exc)
            return False, None
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            return False, None  # aborted or errored: nothing to hand over
        num_tokens = len(request.prompt_token_ids or ())
        needed = _ceil_div(num_tokens, self.block_size)
        if num_tokens == 0 or len(block_ids) < needed:
            return False, None
        held = tuple(int(b) for b in block_ids[:needed])
        transfer_id, pushed = issued or (pp.transfer_id or make_transfer_id(pp.request_id), False)
        self._meta.holds.append(
            HoldSpec(
                request.request_id,
                transfer_id,
                held,
                self.config.transfer_timeout_s,
                pp.decode_engine_id or "",
            )
        )
        with self._lock:
            self._sending.add(request.request_id)
        log.info(
            "transfer %s: holding %d blocks (%d tokens) for request %s",
            transfer_id,
            len(held),
            num_tokens,
            pp.request_id,
        )
        out = DecodeRequestParams(
            request_id=pp.request_id,
            transfer_id=transfer_id,
            engine_id=self.engine_id,
            kv_endpoint=self.config.kv_endpoint(),
            block_ids=list(held),
            num_tokens=num_tokens,
            kv_layout=self.fingerprint,
            transport=self.config.transport,
            tp_size=self.tp_size,
            pushed=pushed,
            prompt_hash=prompt_fingerprint(request.prompt_token_ids or ()),
        )
        return True, out.to_dict()
