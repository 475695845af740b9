"""Fixtures shared by every test area. Area fixtures live in tests/<kind>/<area>/conftest.py."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def free_port() -> Callable[[], int]:
    """Returns a function giving a currently free TCP port on 127.0.0.1."""
    return _free_port
