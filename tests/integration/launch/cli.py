"""`pdplane ...` run as a subprocess, as a user's shell would, for the launch tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping

__all__ = ["run_pdplane"]


def run_pdplane(
    *args: str, timeout_s: float = 60.0, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs `pdplane ARGS...` (this interpreter's `pdplane.cli.main`) to its end, with this
    environment plus `env`, and returns its exit code, stdout and stderr (text). Raises
    subprocess.TimeoutExpired past `timeout_s` seconds."""
    return subprocess.run(
        [sys.executable, "-m", "pdplane.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **(env or {})},
    )
