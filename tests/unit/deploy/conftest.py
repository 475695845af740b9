"""Loads the container scripts of deploy/docker/ (plain scripts, not package modules)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

DOCKER_DIR = Path(__file__).resolve().parents[3] / "deploy" / "docker"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"deploy_docker_{name}", DOCKER_DIR / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def healthcheck() -> ModuleType:
    """deploy/docker/healthcheck.py (`pdplane-healthcheck` in the images)."""
    return _load("healthcheck")


@pytest.fixture(scope="session")
def requirements() -> ModuleType:
    """deploy/docker/requirements.py (dependency list for the image builds)."""
    return _load("requirements")


@pytest.fixture(scope="session")
def vllm_instance() -> ModuleType:
    """deploy/docker/vllm_instance.py (`pdplane-vllm-cpu` in the vllm-cpu image)."""
    return _load("vllm_instance")
