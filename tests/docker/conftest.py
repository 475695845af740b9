"""Fixtures for the checks against a running docker compose stack (`deploy/ci/compose-check.sh`).

The stage script starts the engine, brings the `cpu` profile up and exports where it is:
PDPLANE_STACK_GATEWAY (http://127.0.0.1:PORT) and PDPLANE_STACK_REGISTRY (127.0.0.1:PORT),
plus DOCKER_HOST / COMPOSE_FILE / COMPOSE_PROJECT_NAME for the `docker compose` CLI. Without
them these tests are skipped: they never start an engine by themselves.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator

import httpx
import pytest

pytestmark = pytest.mark.docker


def _stack_env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.skip(f"no compose stack ({name} unset; run deploy/ci/compose-check.sh)")
    return value


@pytest.fixture(scope="session")
def gateway_url() -> str:
    """Base URL of the gateway's published port."""
    return _stack_env("PDPLANE_STACK_GATEWAY")


@pytest.fixture(scope="session")
def registry_addr() -> str:
    """host:port of the registry's published gRPC port."""
    return _stack_env("PDPLANE_STACK_REGISTRY")


@pytest.fixture(scope="session")
def scheduler_addr() -> str:
    """host:port of the scheduler's published gRPC port."""
    return _stack_env("PDPLANE_STACK_SCHEDULER")


@pytest.fixture(scope="session")
def http(gateway_url: str) -> Iterator[httpx.Client]:
    """An HTTP client on the gateway (tiny model on 2 CPU cores: generous read timeout)."""
    with httpx.Client(base_url=gateway_url, timeout=httpx.Timeout(120.0, connect=5.0)) as c:
        yield c


@pytest.fixture(scope="session")
def model(http: httpx.Client) -> str:
    """The served model name, as the gateway's /v1/models lists it."""
    resp = http.get("/v1/models")
    assert resp.status_code == 200, resp.text
    ids = [m["id"] for m in resp.json()["data"]]
    assert ids, "gateway lists no model"
    return str(ids[0])


DockerCli = Callable[..., str]


def _run(argv: list[str], timeout_s: float) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, f"{' '.join(argv)}: rc={result.returncode}: {result.stderr}"
    return result.stdout


@pytest.fixture(scope="session")
def docker(gateway_url: str) -> DockerCli:
    """`docker(*args, timeout_s=60)`: runs the docker CLI on the stage's engine; returns stdout.

    `docker("compose", ...)` addresses the stage's compose project (COMPOSE_FILE and
    COMPOSE_PROJECT_NAME come from the environment). A non-zero exit fails the test.
    """

    def run(*args: str, timeout_s: float = 60.0) -> str:
        return _run(["docker", *args], timeout_s)

    return run
