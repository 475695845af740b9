"""The API server in front of an engine: a request's time from the HTTP server to the scheduler.

Two terms of the cost model (`pdplane.sim.profiles.CostModel`, both ms per request):

- `serial_request_ms`: time on the API server's single FIFO (vLLM's API server handles its
  requests one after another on one event loop: parsing, tokenization, the hop to the engine
  core). A request starts its turn when it arrives or when the one before it is done, whichever
  is later, so a burst of k requests sent at once reaches the engine at 1, 2, ..., k x
  `serial_request_ms`;
- `request_ms`: then a delay every request pays in parallel (the rest of the way in).

Every driver of the engine model uses this one class on its own clock (the served simulator's
runner, `pdplane.plan.fleetsim`'s virtual clock, `pdplane.plan.fit.predict`), one per instance,
so all three predict the same arrival-to-engine times.
"""

from __future__ import annotations

from pdplane.sim.profiles import CostModel

__all__ = ["Frontend"]


class Frontend:
    """One instance's API server: `admit(now)` is when a request sent at `now` reaches the engine.

    Times are modelled seconds on the caller's clock; `admit` must be called in the order the
    requests arrive (non-decreasing `now`), which is FIFO order.
    """

    __slots__ = ("_free_at", "_hop_s", "_serial_s")

    def __init__(self, cost: CostModel) -> None:
        self._serial_s = cost.serial_request_ms * 1e-3
        self._hop_s = cost.request_ms * 1e-3
        self._free_at = float("-inf")

    def admit(self, now: float) -> float:
        """Time (s) at which the request sent at `now` (s) enters the scheduler (>= `now`)."""
        if self._serial_s:
            self._free_at = max(now, self._free_at) + self._serial_s
            return self._free_at + self._hop_s
        return now + self._hop_s
