"""Decode side of a disaggregated request: getting a remote prefill's KV (pull or push).

Called by the engine runner once the request holds blocks for its prompt (vLLM's
WAITING_FOR_REMOTE_KVS). Tokens the local prefix cache already had are not transferred (the
pull shrinks to the rest). Outcomes, as the pdplane connector reports them to vLLM:
- pushed KV in the receive buffer: a local copy (modelled at `_LOCAL_COPY_GBPS`);
- a push the buffer refused: pull it (`push_overflow="pull"`) or recompute the prompt
  (`"recompute"`, the seed's overflow), counted either way;
- a pull: `SimConfig.transfer_s(tokens)` of modelled time, then `CompleteTransfer` on prefill;
- a failed pull (unknown transfer, unreachable prefill, layout mismatch): per
  `kv_load_failure_policy`, recompute locally or fail the request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdplane.core import tracing
from pdplane.sim.engine import EngineRequest
from pdplane.sim.kvflow import KvIntent
from pdplane.sim.push import Taken
from pdplane.sim.records import RequestRecord

if TYPE_CHECKING:
    from pdplane.sim.state import SimState

__all__ = ["KvLoader", "LoadContext"]

#: Copy speed from the receive buffer into the KV cache (GB/s; a device-local copy).
_LOCAL_COPY_GBPS = 100.0


@dataclass(slots=True)
class LoadContext:
    """What the loader needs to know about a request (kept on `EngineRequest.waiter`'s side)."""

    intent: KvIntent
    record: RequestRecord


class KvLoader:
    """The `Loader` of one decode sim (see `pdplane.sim.runner.Loader`)."""

    def __init__(self, state: SimState) -> None:
        self._s = state
        self.contexts: dict[EngineRequest, LoadContext] = {}

    async def __call__(self, req: EngineRequest) -> bool | None:
        ctx = self.contexts.pop(req, None)
        if ctx is None:
            return True
        # Traced like the connector's decode side: one span per transfer in the request's
        # trace (covering the modelled transfer and CompleteTransfer, whose serving span on
        # the prefill sim is its child).
        decode = ctx.intent.decode
        parent = decode.traceparent if decode is not None else ""
        with tracing.span("pdplane.kv_pull", parent=parent or None):
            return await self._load(req, ctx)

    async def _load(self, req: EngineRequest, ctx: LoadContext) -> bool | None:
        s, c = self._s, self._s.config
        stats = s.core.stats
        tokens = max(0, min(req.remote_tokens, len(req.prompt)) - req.local_hit)
        decode = ctx.intent.decode
        ctx.record.kv = {
            "role": "consumer",
            "transfer_id": decode.transfer_id if decode else None,
            "result": "nixl",
        }
        stats.external_queries += len(req.prompt) - req.local_hit
        stats.kv_loads += 1
        failure: str | None = None
        recompute = False
        if decode is not None and decode.kv_layout != s.layout_fingerprint:
            failure = f"layout {decode.kv_layout} != {s.layout_fingerprint}"
        else:
            found = Taken.ABSENT
            if decode is not None and decode.pushed and s.push_buffer is not None:
                found, nbytes = s.push_buffer.take(decode.transfer_id, decode.engine_id)
            if found is Taken.PUSHED:
                await s.runner.sleep(nbytes / (_LOCAL_COPY_GBPS * 1e9))
                stats.push_received += 1
            elif found is Taken.REFUSED and c.push_overflow == "recompute":
                failure, recompute = "receive buffer overflow: recomputed", True
                stats.push_refused += 1
                stats.push_overflow_recomputes += 1
            else:
                if found is Taken.REFUSED:
                    stats.push_refused += 1
                await s.runner.sleep(c.transfer_s(tokens))
        if decode is not None:
            answer = await s.peers.complete(
                decode.kv_endpoint, decode.transfer_id, success=failure is None
            )
            failure = failure or answer
            ctx.record.kv["result"] = f"failed: {failure}" if failure else "pulled"
        if failure is None:
            stats.external_hits += tokens
            stats.kv_bytes_in += tokens * c.kv_bytes_per_token
            return True
        if recompute or c.kv_load_failure_policy == "recompute":
            return False
        return None
