"""Slow or idle clients cannot hold the gateway's connections: header and body deadlines, a cap."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack
from urllib.parse import urlsplit

import pytest

from pdplane.gateway.testing import running_gateway
from tests.unit.gateway.conftest import VIEW, FakeScheduler

_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"


@pytest.fixture
def gateway() -> Iterator[tuple[str, int]]:
    with running_gateway(
        scheduler_port=FakeScheduler([]),
        fleet=lambda: VIEW,
        header_timeout_s=0.5,
        body_timeout_s=0.5,
        max_client_connections=8,
    ) as url:
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None
        yield parts.hostname, parts.port


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """(whether the server closed `sock` within `seconds`, what it sent before)."""
    sock.settimeout(seconds)
    got = b""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            data = sock.recv(65536)
            if not data:
                return True, got
            got += data
    except TimeoutError:
        return False, got
    except ConnectionResetError:
        return True, got
    return False, got


@pytest.mark.parametrize("sent", [b"", _HEAD[:20], _HEAD])
def test_a_connection_without_complete_headers_is_closed(
    gateway: tuple[str, int], sent: bytes
) -> None:
    with socket.create_connection(gateway) as sock:
        sock.sendall(sent)
        closed, _ = _closed_within(sock, 5)
    assert closed


def _head(path: str) -> bytes:
    return _HEAD.replace(b"/v1/completions", path.encode())


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize", "/detokenize"])
def test_a_body_slower_than_the_body_timeout_is_408(gateway: tuple[str, int], path: str) -> None:
    with socket.create_connection(gateway) as sock:
        sock.sendall(_head(path) + b"Content-Length: 100\r\n\r\n" + b'{"prompt": ')
        _, answer = _closed_within(sock, 5)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"RequestTimeoutError"' in answer


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_a_client_gone_mid_body_leaves_no_error_logged(
    gateway: tuple[str, int], path: str, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.create_connection(gateway) as sock:
        sock.sendall(_head(path) + b"Content-Length: 100\r\n\r\n" + b'{"prompt": ')
    with socket.create_connection(gateway) as sock:  # then the gateway still answers
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
        _closed_within(sock, 5)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_connections_past_the_cap_get_503(gateway: tuple[str, int]) -> None:
    with ExitStack() as stack:
        for _ in range(8):
            stack.enter_context(socket.create_connection(gateway))
        with socket.create_connection(gateway) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
            closed, answer = _closed_within(sock, 5)
    assert closed  # the refusal closes the connection
    assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    error = json.loads(body)["error"]  # an OpenAI-style error, as every other refusal
    assert (error["type"], error["code"]) == ("ServiceUnavailableError", 503)
    assert "--max-client-connections 8" in error["message"]
