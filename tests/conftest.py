"""Fixtures shared by every test area. Area fixtures live in tests/<kind>/<area>/conftest.py."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from pdplane.models.tiny import build_tiny_model


def pytest_configure(config: pytest.Config) -> None:
    """Tests stop the commands they start with SIGINT, as Ctrl-C does, and a command inherits
    an ignored SIGINT: a pytest started in the background of a non-interactive shell (`cmd &`,
    which ignores SIGINT there) would pass that on, and every such command would ignore its
    Ctrl-C. A handler of our own is reset to the default in each command started."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """Directory of the tiny local Llama model, tokenizer and chat template included (built
    once, then cached)."""
    cache = Path(os.environ.get("PDPLANE_MODEL_CACHE", Path.home() / ".cache/pdplane/models"))
    return build_tiny_model(cache)
