"""Fixtures shared by every test area. Area fixtures live in tests/<kind>/<area>/conftest.py."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from pdplane.models.tiny import build_tiny_model


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def free_port() -> Callable[[], int]:
    """Returns a function giving a currently free TCP port on 127.0.0.1."""
    return _free_port


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """Directory of the tiny local Llama model, tokenizer and chat template included (built
    once, then cached)."""
    cache = Path(os.environ.get("PDPLANE_MODEL_CACHE", Path.home() / ".cache/pdplane/models"))
    return build_tiny_model(cache)
