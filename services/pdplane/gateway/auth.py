"""Optional API keys: `Authorization: Bearer <key>` on /v1/* (`--api-key`)."""

from __future__ import annotations

import hmac

__all__ = ["CONFLICT", "ApiKeys"]

#: Stands for "more than one Authorization header": never allowed when keys are required.
CONFLICT = b"\x00conflicting authorization headers"


class ApiKeys:
    """The accepted keys; no keys = every request is allowed."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._expected = tuple(f"Bearer {k}".encode() for k in keys)

    def allows(self, authorization: bytes | None) -> bool:
        """Whether the raw `Authorization` header value carries one of the keys."""
        if not self._expected:
            return True
        if authorization is CONFLICT:
            return False
        got = authorization or b""
        # Compare against every key (constant time per key) so timing says nothing of which.
        return any([hmac.compare_digest(got, e) for e in self._expected])
