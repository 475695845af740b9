"""One request's trace on real vLLM CPU: spans from five processes in one tree.

`pdplane up`'s stack (registry, scheduler, gateway, prefill, decode as processes) with only
`OTEL_EXPORTER_OTLP_ENDPOINT` set, exporting to an OTLP receiver in the test: the gateway's
spans, the scheduler's decision (gRPC metadata), vLLM's own `llm_request` spans (HTTP
`traceparent`) and the connector's `kv_pull` (decode engine, `kv_transfer_params`) and
`kv_serve` (prefill engine, gRPC metadata) share the client's trace id and parent correctly.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from bench.vllm_cpu.ttft_breakdown import breakdown, running_stack, timed_stream

pytestmark = pytest.mark.vllm

# `pdplane up` numbers its instances across roles: 1P1D is prefill-0 and decode-1.
PREFILL, DECODE = "prefill-0", "decode-1"


def test_trace_tree_across_processes(tmp_path: Path) -> None:
    rng = random.Random(7)
    with running_stack(tmp_path, 1024, single=False) as stack:
        trace_id = os.urandom(16).hex()
        client_span = os.urandom(8).hex()
        prompt = [rng.randrange(8, 2048) for _ in range(300)]
        headers = {"traceparent": f"00-{trace_id}-{client_span}-01"}
        ttft, gaps = timed_stream(stack.gateway, stack.model, prompt, 4, headers)

        def complete(spans: list) -> bool:  # type: ignore[type-arg]
            mine = [s for s in spans if s.trace_id == trace_id]
            # Every span read below: each process exports on its own schedule, so decode's
            # kv_pull can arrive after the gateway's first_byte and prefill's kv_serve.
            return sum(s.name == "llm_request" for s in mine) >= 2 and {
                "pdplane.request",
                "pdplane.schedule",
                "pdplane.prefill_leg",
                "pdplane.decode_leg",
                "pdplane.kv_pull",
                "pdplane.kv_serve",
                "pdplane.scheduler.decision",
                "pdplane.first_byte",
            } <= {s.name for s in mine}

        spans = [s for s in stack.receiver.wait_for(complete, 60) if s.trace_id == trace_id]
    by = {s.name: s for s in spans if s.name != "llm_request"}
    root = by["pdplane.request"]
    assert root.parent_id == client_span and root.service == "pdplane-gateway"
    for name in ("pdplane.schedule", "pdplane.prefill_leg", "pdplane.decode_leg"):
        assert by[name].parent_id == root.span_id and by[name].service == "pdplane-gateway"
    decision = by["pdplane.scheduler.decision"]
    assert decision.parent_id == by["pdplane.schedule"].span_id
    assert decision.service == "pdplane-scheduler"
    pull, serve = by["pdplane.kv_pull"], by["pdplane.kv_serve"]
    assert pull.parent_id == root.span_id and pull.service == DECODE
    assert serve.parent_id == pull.span_id and serve.service == PREFILL
    assert pull.start_ns <= serve.start_ns <= serve.end_ns <= pull.end_ns
    engines = {s.parent_id: s for s in spans if s.name == "llm_request"}
    assert engines[by["pdplane.prefill_leg"].span_id].service == PREFILL
    assert engines[by["pdplane.decode_leg"].span_id].service == DECODE
    phases = breakdown(spans, ttft, ttft + gaps[0])
    # "relay" is measured to decode's first chunk, which follows the client's first token when
    # that comes from prefill (gateway.first_token): it is negative then.
    assert all(v >= 0 for k, v in phases.items() if not k.startswith("relay")), phases
