"""API keys: `Authorization: Bearer <key>` on /v1/* (`--api-key`, `--tenants`), and who a key
speaks for (`pdplane.gateway.tenants`)."""

from __future__ import annotations

from pdplane.gateway.tenants import ANONYMOUS, Identity, TenantBook

__all__ = ["CONFLICT", "ApiKeys"]

#: Stands for "more than one Authorization header": never allowed when keys are required.
CONFLICT = b"\x00conflicting authorization headers"


class ApiKeys:
    """The accepted keys (those of `--api-key` and of the tenants file); none = every request
    is allowed, as tenant "default"."""

    def __init__(self, book: TenantBook) -> None:
        self.book = book

    def identify(self, authorization: bytes | None, named: str = "") -> Identity | None:
        """Who the raw `Authorization` header value speaks for (`named`: the tenant header's
        value, read for a trusted proxy's key); None = refused (401)."""
        if authorization is CONFLICT:
            return None if self.book.required else ANONYMOUS
        return self.book.identify(authorization, named)

    def allows(self, authorization: bytes | None) -> bool:
        """Whether the raw `Authorization` header value carries an accepted key."""
        return self.identify(authorization) is not None
