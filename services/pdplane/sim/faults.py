"""Failure injection: which requests fail, and how; and the instance's own death.

Every fault is reproducible: by count (`fail_next`), by the request's id (`fail_request_prefix`,
matched against the `X-Request-Id` a gateway sends), or by seed (`failure_rate`). A
`kill_after_tokens` kills the whole instance as a SIGKILL would (`pdplane.sim.instance`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from pdplane.sim.config import FailMode

__all__ = ["FaultPlan"]

_MODES = ("http500", "drop", "stall")


@dataclass(slots=True)
class FaultPlan:
    """Per-request fault draw.

    Attributes:
        failure_rate: probability (0..1) that a request fails.
        fail_mode: "http500" (error before any byte), "drop" (connection closed after
            `fail_after_tokens` streamed tokens, or before a non-streamed body) or "stall" (no
            more bytes after `fail_after_tokens` tokens, until the client gives up). A stream
            with `fail_after_tokens` 0 fails inside its first token's event: the headers (and
            chat's role chunk) and half of that event's bytes go out first.
        fail_next: the next N requests fail regardless of the rate (deterministic tests).
        fail_request_prefix: requests whose id starts with this fail ("" = none), whatever the
            rate: one chosen stream of many.
        kill_after_tokens: once any stream of this instance has streamed this many tokens, the
            instance dies (0 = never): every open connection is cut, nothing more answers, and
            it does not deregister (its lease lapses), as with a SIGKILLed engine.
    """

    failure_rate: float = 0.0
    fail_mode: FailMode = "http500"
    fail_after_tokens: int = 1
    fail_next: int = 0
    fail_request_prefix: str = ""
    kill_after_tokens: int = 0
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def draw(self, request_id: str = "") -> FailMode | None:
        """The fault for the next request (`request_id`: its X-Request-Id), or None."""
        if self.fail_request_prefix and request_id.startswith(self.fail_request_prefix):
            return self.fail_mode
        if self.fail_next > 0:
            self.fail_next -= 1
            return self.fail_mode
        if self.failure_rate > 0 and self._rng.random() < self.failure_rate:
            return self.fail_mode
        return None

    def update(self, changes: dict[str, Any]) -> None:
        """Applies a `POST /sim/faults` body. Raises ValueError on an unknown or bad field."""
        for key, value in changes.items():
            if key == "failure_rate":
                if not isinstance(value, int | float) or not 0 <= value <= 1:
                    raise ValueError("failure_rate must be a number within [0, 1]")
                self.failure_rate = float(value)
            elif key == "fail_mode":
                if value not in _MODES:
                    raise ValueError(f"fail_mode must be one of {', '.join(_MODES)}")
                self.fail_mode = value
            elif key == "fail_request_prefix":
                if not isinstance(value, str) or len(value) > 256:
                    raise ValueError("fail_request_prefix must be a string of <= 256 characters")
                self.fail_request_prefix = value
            elif key in ("fail_after_tokens", "fail_next", "kill_after_tokens"):
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ValueError(f"{key} must be a non-negative integer")
                setattr(self, key, value)
            else:
                raise ValueError(f"unknown fault field {key!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "failure_rate": self.failure_rate,
            "fail_mode": self.fail_mode,
            "fail_after_tokens": self.fail_after_tokens,
            "fail_next": self.fail_next,
            "fail_request_prefix": self.fail_request_prefix,
            "kill_after_tokens": self.kill_after_tokens,
        }
