"""Errors of a scheduling decision; the servicer maps them onto gRPC status codes."""

from __future__ import annotations

__all__ = ["InvalidRequest", "NoInstance"]


class InvalidRequest(ValueError):
    """The request is malformed (gRPC INVALID_ARGUMENT); the message names the field."""


class NoInstance(Exception):
    """No compatible instance for one side (gRPC UNAVAILABLE).

    `side` is "prefill", "decode" or "pair" (both sides exist but no layout/transport/length
    matches); the message names it, e.g. "no prefill instance for model tiny: ...".
    """

    def __init__(self, side: str, message: str) -> None:
        super().__init__(message)
        self.side = side
