"""An in-process OTLP/gRPC trace receiver on loopback: what a collector would get.

with otlp_receiver() as receiver:
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
    ...
    spans = receiver.wait_for(lambda spans: ..., timeout_s=10)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

__all__ = ["OtlpReceiver", "ReceivedSpan", "otlp_receiver"]


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    """One exported span; ids as hex strings (parent "" for a root)."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects every span exported to it."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self.spans: list[ReceivedSpan] = []
        self.endpoint = ""

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        got = []
        for rs in request.resource_spans:
            attrs = {a.key: _value(a.value) for a in rs.resource.attributes}
            service = str(attrs.get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        ReceivedSpan(
                            s.name,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            service,
                            s.start_time_unix_nano,
                            s.end_time_unix_nano,
                            {a.key: _value(a.value) for a in s.attributes},
                        )
                    )
        with self._lock:
            self.spans.extend(got)
            self._lock.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(
        self, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 10.0
    ) -> list[ReceivedSpan]:
        """The spans once `done(spans)` holds; AssertionError with what came after timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not done(self.spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted((s.service, s.name) for s in self.spans)
                    raise AssertionError(f"spans not complete after {timeout_s} s: {names}")
                self._lock.wait(left)
            return list(self.spans)


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """A receiver listening on 127.0.0.1 (random port); `endpoint` is its http:// URL."""
    receiver = OtlpReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    receiver.endpoint = f"http://127.0.0.1:{port}"
    try:
        yield receiver
    finally:
        server.stop(0)
