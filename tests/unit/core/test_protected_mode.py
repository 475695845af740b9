"""Protected mode: a service on a non-loopback address without a token refuses to start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from pdplane.core.grpc.auth import InsecureBindError, check_bind, is_loopback
from pdplane.registry.settings import RegistrySettings
from pdplane.scheduler.settings import SchedulerSettings


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"])
def test_loopback_needs_no_token(host: str) -> None:
    assert is_loopback(host)
    check_bind("svc", host, None, insecure=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "registry.example"])
def test_non_loopback_without_token_is_refused(host: str) -> None:
    with pytest.raises(InsecureBindError, match="--insecure"):
        check_bind("svc", host, None, insecure=False)
    check_bind("svc", host, "t", insecure=False)
    check_bind("svc", host, None, insecure=True)


def test_registry_and_scheduler_settings_refuse_an_open_non_loopback_bind() -> None:
    with pytest.raises(ValidationError, match=r"refusing to listen on 0\.0\.0\.0"):
        RegistrySettings(host="0.0.0.0")
    with pytest.raises(ValidationError, match=r"refusing to listen on 0\.0\.0\.0"):
        SchedulerSettings(registry="127.0.0.1:1", host="0.0.0.0")
    assert RegistrySettings(host="0.0.0.0", token="t").token == "t"
    assert RegistrySettings(host="0.0.0.0", insecure=True).insecure
    assert SchedulerSettings(registry="127.0.0.1:1", host="0.0.0.0", insecure=True).insecure


@pytest.mark.parametrize("command", ["registry", "scheduler"])
def test_the_command_exits_before_listening(command: str) -> None:
    argv = [sys.executable, "-m", "pdplane.cli.main", command, "--host", "0.0.0.0", "--port", "0"]
    if command == "scheduler":
        argv += ["--registry", "127.0.0.1:1"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=_clean_env())
    assert out.returncode == 2
    assert "refusing to listen on 0.0.0.0 without a token" in out.stderr


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PDPLANE_")}
