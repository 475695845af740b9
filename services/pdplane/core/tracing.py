"""OpenTelemetry spans at the seams between the parts; off by default, free when off.

One switch, the OpenTelemetry SDK's own: tracing is on in a process when
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` is set (and neither
`OTEL_SDK_DISABLED=true` nor `OTEL_TRACES_EXPORTER=none`). Spans then go to that OTLP endpoint,
over gRPC unless `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` / `OTEL_EXPORTER_OTLP_PROTOCOL` says
`http/protobuf` (vLLM's `--otlp-traces-endpoint` defaults to gRPC too). The exporter reads its
other `OTEL_EXPORTER_OTLP_*` settings itself; the service name is `OTEL_SERVICE_NAME`, else the
name the process passes to `configure`, and `OTEL_RESOURCE_ATTRIBUTES` adds to the resource.

Each process calls `configure(default_service_name)` once at start. Until then, and whenever
tracing is off, `span` returns one shared no-op context manager and the other helpers return
their input: OpenTelemetry is imported only when tracing is on (the connector imports this
module inside vLLM's engine process).

Context crosses processes as a W3C `traceparent` string: in HTTP headers (`inject_headers`),
in gRPC metadata (`grpc_metadata` / `grpc_parent`) and, into the connector, in
`kv_transfer_params.pdplane_traceparent` (vLLM hands HTTP headers to the engine only when its
own tracing is on). The provider is this module's own, not OpenTelemetry's global one, so it
never clashes with vLLM's (which sets the global provider in the same processes).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

__all__ = [
    "TRACEPARENT",
    "configure",
    "current_traceparent",
    "enabled",
    "env_enabled",
    "flush",
    "grpc_metadata",
    "grpc_parent",
    "inject_headers",
    "record_span",
    "shutdown",
    "span",
    "stamp_kv_params",
    "traces_endpoint",
]

#: The W3C trace context header / metadata key.
TRACEPARENT = "traceparent"
#: Its key in `kv_transfer_params` (`DecodeRequestParams.traceparent`).
_KV_TRACEPARENT = "pdplane_traceparent"

_Metadata = tuple[tuple[str, str], ...]
_NOOP: contextlib.nullcontext[None] = contextlib.nullcontext()
_lock = threading.Lock()
_tracer: Tracer | None = None
_provider: TracerProvider | None = None


def env_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether the OpenTelemetry environment in `env` (default: this process's) asks for
    traces: an OTLP endpoint is set and neither the SDK nor the traces exporter is off."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(
        env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def _protocol(env: Mapping[str, str]) -> str:
    return (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    ) or "grpc"


def traces_endpoint(env: Mapping[str, str] | None = None) -> str | None:
    """The OTLP traces endpoint `env` asks for (None when traces are off), as one URL for a
    process that takes it as a flag (vLLM's `--otlp-traces-endpoint`): the signal-specific
    variable as it is, else the base endpoint (+ `/v1/traces` over http/protobuf, as the
    OpenTelemetry spec derives it)."""
    env = os.environ if env is None else env
    if not env_enabled(env):
        return None
    specific = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if specific:
        return specific
    base = env["OTEL_EXPORTER_OTLP_ENDPOINT"]
    if _protocol(env) == "http/protobuf":
        return base.rstrip("/") + "/v1/traces"
    return base


def _otlp_exporter() -> SpanExporter:
    protocol = _protocol(os.environ)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol != "grpc":
        raise ValueError(f"unsupported OTLP protocol {protocol!r} (grpc or http/protobuf)")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcExporter,
    )

    return GrpcExporter()


def configure(default_service_name: str, exporter: SpanExporter | None = None) -> bool:
    """Turns tracing on for this process if the environment asks for it (or `exporter` is
    given: tests); returns whether it is on. Idempotent: the first call that turns it on wins.

    Spans are batched (`BatchSpanProcessor`) and exported off the hot path; `shutdown`
    flushes them. Raises ValueError for an unsupported OTLP protocol.
    """
    global _tracer, _provider
    if _tracer is not None:
        return True
    if exporter is None and not env_enabled():
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    with _lock:
        if _tracer is not None:
            return True
        name = os.environ.get("OTEL_SERVICE_NAME") or default_service_name
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
        provider.add_span_processor(BatchSpanProcessor(exporter or _otlp_exporter()))
        _provider = provider
        _tracer = provider.get_tracer("pdplane")
    return True


def enabled() -> bool:
    """Whether spans are recorded in this process."""
    return _tracer is not None


def flush(timeout_ms: int = 1000) -> None:
    """Exports the spans that ended so far (bounded by `timeout_ms`); tracing stays on."""
    provider = _provider
    if provider is not None:
        provider.force_flush(timeout_ms)


def shutdown() -> None:
    """Flushes and stops the exporter (bounded by the SDK's own export timeout); tracing is
    off afterwards (tests: the next `configure` starts afresh)."""
    global _tracer, _provider
    with _lock:
        provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def _context_of(traceparent: str | None) -> Any:
    if not traceparent:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({TRACEPARENT: traceparent})


def span(
    name: str,
    *,
    parent: str | None = None,
    attributes: Mapping[str, Any] | None = None,
    server: bool = False,
    current: bool = True,
) -> contextlib.AbstractContextManager[Span | None]:
    """A span around a `with` block (None inside when tracing is off).

    `parent`: a `traceparent` from another process; None = the current span (if any).
    `server`: SpanKind.SERVER (the span answers a remote call), else INTERNAL.
    `current`: make it the current span inside the block (children and propagation follow
    it); False for blocks that yield in a generator served by another thread's loop.
    Exceptions leaving the block are recorded on the span and set its status to ERROR.
    """
    tracer = _tracer
    if tracer is None:
        return _NOOP
    return _span(tracer, name, parent, attributes, server, current)


@contextlib.contextmanager
def _span(
    tracer: Tracer,
    name: str,
    parent: str | None,
    attributes: Mapping[str, Any] | None,
    server: bool,
    current: bool,
) -> Iterator[Span]:
    from opentelemetry.trace import SpanKind, use_span

    kind = SpanKind.SERVER if server else SpanKind.INTERNAL
    s = tracer.start_span(name, _context_of(parent), kind, attributes)
    if current:
        with use_span(s, end_on_exit=True):
            yield s
        return
    try:
        yield s
    except BaseException as exc:
        s.record_exception(exc)
        raise
    finally:
        s.end()


def record_span(name: str, start_ns: int, attributes: Mapping[str, Any] | None = None) -> None:
    """Records a finished span from `start_ns` (time.time_ns()) to now under the current
    span, for an interval whose start is known only afterwards (e.g. the first byte)."""
    tracer = _tracer
    if tracer is not None:
        tracer.start_span(name, None, attributes=attributes, start_time=start_ns).end()


def current_traceparent() -> str | None:
    """The current span's `traceparent` (None when off or outside any span)."""
    if _tracer is None:
        return None
    carrier: dict[str, str] = {}
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get(TRACEPARENT)


def inject_headers(headers: dict[str, str]) -> dict[str, str]:
    """`headers` plus the current `traceparent` (a copy), or `headers` itself when off."""
    tp = current_traceparent()
    return {**headers, TRACEPARENT: tp} if tp else headers


def stamp_kv_params(params: dict[str, Any]) -> None:
    """Adds the current `traceparent` to a `kv_transfer_params` dict (nothing when off)."""
    tp = current_traceparent()
    if tp:
        params[_KV_TRACEPARENT] = tp


def grpc_metadata(metadata: _Metadata) -> _Metadata:
    """gRPC call metadata plus the current `traceparent` (`metadata` itself when off)."""
    tp = current_traceparent()
    return (*metadata, (TRACEPARENT, tp)) if tp else metadata


def grpc_parent(context: Any) -> str | None:
    """The caller's `traceparent` from a gRPC servicer context (sync or aio), if any."""
    if _tracer is None:
        return None
    for key, value in context.invocation_metadata() or ():
        if key == TRACEPARENT:
            return str(value)
    return None
