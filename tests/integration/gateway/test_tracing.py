"""One request's spans form one tree across gateway -> scheduler -> decode -> prefill.

Sims stand in for the engines: they propagate and record the connector's spans the way the
connector does (`pdplane.kv_pull` on decode, `pdplane.kv_serve` on prefill as its child; see
docs/tracing.md for what differs). Spans go through the real OTLP/gRPC exporter to an
in-process receiver, switched on by `OTEL_EXPORTER_OTLP_ENDPOINT` alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest

from pdplane.core import tracing
from tests.integration.gateway.conftest import MODEL, Stack
from tests.support.otlp import OtlpReceiver, ReceivedSpan

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"

GATEWAY_CHILDREN = {
    "pdplane.schedule",
    "pdplane.prefill_leg",
    "pdplane.decode_leg",
    "pdplane.first_byte",
    "pdplane.kv_pull",
}


def _complete(spans: list[ReceivedSpan]) -> bool:
    names = {s.name for s in spans}
    return {"pdplane.request", "pdplane.scheduler.decision", "pdplane.kv_serve"} | (
        GATEWAY_CHILDREN
    ) <= names


@pytest.mark.parametrize("embedded", [False, True], ids=["remote", "embedded"])
def test_one_tree_from_client_to_prefill(
    receiver: OtlpReceiver, stack_factory: Callable[..., Stack], embedded: bool
) -> None:
    stack = stack_factory(embedded=embedded)
    sims = stack.sims(["prefill", "decode"], itl_ms=1)
    stack.wait_ready(sims)
    body = {"model": MODEL, "prompt": "trace me", "max_tokens": 3, "stream": True}
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    with httpx.stream(
        "POST", f"{stack.url}/v1/completions", json=body, headers=headers, timeout=10
    ) as r:
        assert r.status_code == 200
        r.read()
    # The root span ends once the gateway has sent the last byte, which can be a moment after
    # the client read it: flush until every span arrived.
    deadline = time.monotonic() + 10.0
    while True:
        tracing.flush()
        try:
            spans = receiver.wait_for(_complete, timeout_s=0.2)
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise

    by_name = {s.name: s for s in spans}
    assert {s.trace_id for s in spans} == {CLIENT_TRACE}
    root = by_name["pdplane.request"]
    assert root.parent_id == CLIENT_SPAN
    assert root.service == "pdplane-test"
    for name in GATEWAY_CHILDREN:
        assert by_name[name].parent_id == root.span_id, name
    assert by_name["pdplane.scheduler.decision"].parent_id == by_name["pdplane.schedule"].span_id
    assert by_name["pdplane.kv_serve"].parent_id == by_name["pdplane.kv_pull"].span_id
    # Children lie inside their parents, in the order a request runs.
    for s in spans:
        if s is not root and s.parent_id == root.span_id:
            assert root.start_ns <= s.start_ns <= s.end_ns <= root.end_ns, s.name
    assert by_name["pdplane.schedule"].end_ns <= by_name["pdplane.prefill_leg"].start_ns
    assert by_name["pdplane.prefill_leg"].end_ns <= by_name["pdplane.decode_leg"].start_ns
    assert by_name["pdplane.decode_leg"].end_ns <= by_name["pdplane.first_byte"].end_ns


def test_off_without_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    tracing.shutdown()
    assert not tracing.configure("pdplane-gateway")
    assert not tracing.enabled()
    headers = {"x-request-id": "r"}
    assert tracing.inject_headers(headers) is headers
    meta = (("authorization", "Bearer t"),)
    assert tracing.grpc_metadata(meta) is meta
    with tracing.span("x") as s:
        assert s is None
