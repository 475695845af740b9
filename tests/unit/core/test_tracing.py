"""The tracing switch follows the OpenTelemetry environment; the trace context round-trips."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdplane.core import tracing
from pdplane.core.kv_params import DecodeRequestParams
from pdplane.launch.vllm_cpu import VllmCpuInstance, VllmCpuOptions

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_SERVICE_NAME": "gw"}, False),
    ],
)
def test_env_switch(env: dict[str, str], on: bool) -> None:
    assert tracing.env_enabled(env) is on


def test_traceparent_rides_in_kv_transfer_params() -> None:
    params = DecodeRequestParams("r", "t", "p", "127.0.0.1:1", [1], 3, "L", traceparent=TP)
    d = params.to_dict()
    assert d["pdplane_traceparent"] == TP
    assert DecodeRequestParams.from_dict(d).traceparent == TP
    untraced = DecodeRequestParams("r", "t", "p", "127.0.0.1:1", [1], 3, "L").to_dict()
    assert "pdplane_traceparent" not in untraced
    assert DecodeRequestParams.from_dict(untraced).traceparent == ""


def test_spans_link_through_the_carriers() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing.shutdown()
    assert tracing.configure("unit", exporter=exporter)
    try:
        with tracing.span("outer", parent=TP) as outer:
            assert outer is not None
            meta = tracing.grpc_metadata(())
            headers = tracing.inject_headers({})
            kv: dict[str, object] = {}
            tracing.stamp_kv_params(kv)
            tracing.record_span("since", start_ns=0)
        assert meta == (("traceparent", headers["traceparent"]),)
        assert kv["pdplane_traceparent"] == headers["traceparent"]
        with tracing.span("remote", parent=headers["traceparent"], current=False):
            pass
    finally:
        tracing.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    outer_ctx = spans["outer"].context
    assert spans["outer"].parent is not None and spans["outer"].parent.span_id == int(TP[36:52], 16)
    for child in ("since", "remote"):
        assert spans[child].parent is not None
        assert spans[child].parent.span_id == outer_ctx.span_id
        assert spans[child].context.trace_id == outer_ctx.trace_id


def test_vllm_instances_get_the_switch(tmp_path: Path) -> None:
    opts = VllmCpuOptions(model=tmp_path, port=8104, role="kv_producer", instance_id="prefill-0")
    on = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}
    inst = VllmCpuInstance(opts, tmp_path / "t.log", base_env=on)
    argv = inst.command()
    assert argv[argv.index("--otlp-traces-endpoint") + 1] == "http://127.0.0.1:4317"
    assert inst.env()["OTEL_SERVICE_NAME"] == "prefill-0"
    http = {**on, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    assert tracing.traces_endpoint(http) == "http://127.0.0.1:4317/v1/traces"
    off = VllmCpuInstance(opts, tmp_path / "t.log", base_env={})
    assert "--otlp-traces-endpoint" not in off.command()
    assert "OTEL_SERVICE_NAME" not in off.env()
