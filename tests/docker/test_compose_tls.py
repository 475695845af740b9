"""Host-side checks of the compose stack with deploy/docker-compose.tls.yml and a shared token.

Run by `deploy/ci/compose-check.sh` after it re-creates the `cpu` profile with TLS on every gRPC
hop (registry, scheduler, KvTransfer) and PDPLANE_TOKEN set; it exports PDPLANE_STACK_TLS_CA
(the CA of the test certificates) and PDPLANE_STACK_TOKEN. Skipped without them.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdplane.cli import ls

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def tls() -> tuple[str, str]:
    """(CA PEM path, token) of the TLS stack."""
    ca, token = os.environ.get("PDPLANE_STACK_TLS_CA"), os.environ.get("PDPLANE_STACK_TOKEN")
    if not ca or not token:
        pytest.skip("no TLS compose stack (run deploy/ci/compose-check.sh)")
    return ca, token


def _health(registry_addr: str, creds: grpc.ChannelCredentials | None) -> int:
    chan = (
        grpc.secure_channel(registry_addr, creds) if creds else grpc.insecure_channel(registry_addr)
    )
    with chan:
        stub = health_pb2_grpc.HealthStub(chan)
        return int(stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status)


def test_registry_serves_grpc_health_over_tls_only(
    tls: tuple[str, str], registry_addr: str
) -> None:
    creds = grpc.ssl_channel_credentials(Path(tls[0]).read_bytes())
    assert _health(registry_addr, creds) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as exc:
        _health(registry_addr, None)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


def test_ls_needs_the_token_and_lists_the_pair_over_tls(
    tls: tuple[str, str], registry_addr: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ca, token = tls
    base = ["--registry", registry_addr, "--tls-ca", ca, "--json"]
    assert ls.main(base, out=io.StringIO()) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err

    out = io.StringIO()
    assert ls.main([*base, "--token", token], out=out) == 0
    roles = sorted(i["role"] for i in json.loads(out.getvalue()))
    assert roles == ["decode", "prefill"]


def test_completion_with_tls_and_token_on_every_grpc_hop(
    tls: tuple[str, str], http: httpx.Client, model: str
) -> None:
    # Gateway -> scheduler -> registry, the instances' registration and decode's KV pull from
    # prefill all run over TLS with the token here: a 200 with text needs every one of them.
    resp = http.post(
        "/v1/completions",
        json={
            "model": model,
            "prompt": "heartbeat lease over tls",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"]
