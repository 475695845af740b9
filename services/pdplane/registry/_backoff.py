"""Capped exponential backoff with jitter, for the registry client's retry loops."""

from __future__ import annotations

import random


class Backoff:
    """Delays (s) of `initial`, doubling up to `maximum`, each jittered by +-20 %."""

    def __init__(self, initial: float = 0.1, maximum: float = 0.5) -> None:
        self._initial = initial
        self._maximum = maximum
        self._next = initial

    def reset(self) -> None:
        """Starts again from the initial delay (after a success)."""
        self._next = self._initial

    def next_delay(self) -> float:
        """The delay (s) to wait before the next attempt."""
        delay = self._next
        self._next = min(self._next * 2, self._maximum)
        return delay * random.uniform(0.8, 1.2)
