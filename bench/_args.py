"""Argument types shared by the benchmark scripts' command lines (argparse)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["at_least"]


def at_least(least: float, cast: type[int] | type[float]) -> Callable[[str], float]:
    """An argparse type: a finite number of `cast` no smaller than `least`; anything else is
    argparse's usage error (exit 2) naming the value."""

    def parse(text: str) -> float:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value) or value < least:
            raise argparse.ArgumentTypeError(f"{text} is below {least:g} or not finite")
        return value

    return parse
