"""The modelled hour (bench/plan/autoscale_hour.py) runs where only protobuf is installed beside
the standard library (a machine that only runs the table): importing it, the controller and
the fleet simulation pulls in none of the servers' dependencies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SERVERS_ONLY = ("aiohttp", "fastapi", "prometheus_client", "grpc", "numpy", "pydantic")


def test_the_hour_imports_no_server_dependency() -> None:
    code = (
        "import sys, runpy\n"
        "sys.argv = ['autoscale_hour.py', '--help']\n"
        "try:\n"
        "    runpy.run_path('bench/plan/autoscale_hour.py', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print(sorted(m for m in {SERVERS_ONLY!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
