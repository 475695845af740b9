"""deploy/docker/healthcheck.py against real gRPC and HTTP servers on loopback."""

from __future__ import annotations

import http.server
from collections.abc import Iterator
from concurrent import futures
from types import ModuleType

import grpc
import pytest
from grpc_health.v1 import health, health_pb2

from pdplane.core.grpc import util as grpc_util
from pdplane.launch.ports import free_port_run
from tests.loopback_http import serving


@pytest.fixture
def grpc_server() -> Iterator[tuple[str, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = grpc_util.add_health_and_reflection(server, ["pdplane.v1.Registry"])
    port = grpc_util.add_port(server, "127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(grace=None).wait(5)


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        status = 200 if self.path == "/health" else 503
        body = b"{}" if status == 200 else b'{"error": "no usable prefill/decode pair"}'
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_url() -> Iterator[str]:
    with serving(_Handler) as url:
        yield url


def test_grpc_serving_is_healthy(
    healthcheck: ModuleType, grpc_server: tuple[str, health.HealthServicer]
) -> None:
    target, _ = grpc_server
    assert healthcheck.check_grpc(target, "", 2.0) is None
    assert healthcheck.main(["grpc", target]) == 0
    assert healthcheck.main(["grpc", target, "--service", "pdplane.v1.Registry"]) == 0


def test_grpc_not_serving_is_unhealthy_with_status(
    healthcheck: ModuleType, grpc_server: tuple[str, health.HealthServicer]
) -> None:
    target, servicer = grpc_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    reason = healthcheck.check_grpc(target, "", 2.0)
    assert reason is not None and "NOT_SERVING" in reason
    assert healthcheck.main(["grpc", target]) == 1


def test_grpc_unknown_service_is_unhealthy(
    healthcheck: ModuleType, grpc_server: tuple[str, health.HealthServicer]
) -> None:
    target, _ = grpc_server
    reason = healthcheck.check_grpc(target, "no.such.Service", 2.0)
    assert reason is not None and "NOT_FOUND" in reason


def test_grpc_unreachable_is_unhealthy_within_timeout(healthcheck: ModuleType) -> None:
    target = f"127.0.0.1:{free_port_run()}"  # type: ignore[operator]
    reason = healthcheck.check_grpc(target, "", 1.0)
    assert reason is not None and target in reason


def test_http_2xx_is_healthy_and_503_is_not(
    healthcheck: ModuleType, http_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert healthcheck.check_http(f"{http_url}/health", 2.0) is None
    assert healthcheck.main(["http", f"{http_url}/health"]) == 0
    assert healthcheck.main(["http", f"{http_url}/not-ready"]) == 1
    err = capsys.readouterr().err
    assert "HTTP 503" in err and "no usable prefill/decode pair" in err


def test_http_unreachable_is_unhealthy(healthcheck: ModuleType) -> None:
    url = f"http://127.0.0.1:{free_port_run()}/health"  # type: ignore[operator]
    reason = healthcheck.check_http(url, 1.0)
    assert reason is not None and url in reason


def test_usage_error_exits_2(healthcheck: ModuleType) -> None:
    with pytest.raises(SystemExit) as exc:
        healthcheck.main(["tcp", "127.0.0.1:1"])
    assert exc.value.code == 2
