"""Fixtures shared by every test area. Area fixtures live in tests/<kind>/<area>/conftest.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdplane.models.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """Directory of the tiny local Llama model, tokenizer and chat template included (built
    once, then cached)."""
    cache = Path(os.environ.get("PDPLANE_MODEL_CACHE", Path.home() / ".cache/pdplane/models"))
    return build_tiny_model(cache)
