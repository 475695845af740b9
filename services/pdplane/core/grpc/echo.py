"""Bounded echoes of caller input in error messages.

gRPC sends a status's details in the trailers, whose size is limited (8 KiB by default): a
detail quoting a 10,000-character label key or a 1 MB model name reached the client as
RESOURCE_EXHAUSTED "metadata size exceeds limit" instead of the INVALID_ARGUMENT it was. Every
message that quotes a value the caller chose quotes it through `echo`.
"""

from __future__ import annotations

__all__ = ["MAX_ECHO", "echo"]

#: Characters of a value quoted in an error message, before "...".
MAX_ECHO = 64


def echo(value: object, limit: int = MAX_ECHO) -> str:
    """`repr(value)` for a message, cut to `limit` characters of the value; a cut value ends
    in "... (N characters)" with N its full length (of `str(value)`).

    echo("tiny") == "'tiny'"; echo("x" * 10_000) == "'xxx...x'... (10000 characters)".
    """
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return repr(value)
    return f"{text[:limit]!r}... ({len(text)} characters)"
