"""Who may call what on a pdplane gRPC server: the one place where credentials are checked.

Two bearer credentials, both sent as the gRPC metadata `authorization: Bearer <token>`:

- the shared **token**: an instance (or the gateway, the scheduler) may register, heartbeat,
  read and watch, schedule and release, and change only the lease it holds (the lease id,
  never listed, proves it);
- the **admin token**: an operator (`pdplane drain`) may also drain or deregister any instance
  by id.

The admin token is accepted wherever the shared token is. With no token configured at all the
server is open (any caller is an operator: a fleet on loopback, see `check_bind`); with a
token but no admin token nobody may change another instance's lease. A call carrying two
different `authorization` values is refused whatever is configured (a proxy and a client that
disagree must not get to pick the friendlier one). Health and reflection stay open so that
probes work without credentials.
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import grpc

__all__ = [
    "AUTH_KEY",
    "AuthPolicy",
    "CallerRole",
    "ConflictingCredentials",
    "InsecureBindError",
    "check_bind",
    "is_loopback",
]

AUTH_KEY = "authorization"


class CallerRole(enum.IntEnum):
    """What a caller proved, in increasing authority."""

    INSTANCE = 1
    ADMIN = 2


class ConflictingCredentials(ValueError):
    """The call carries more than one distinct `authorization` value."""


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    values = {
        (value.decode(errors="replace") if isinstance(value, bytes) else value)
        for key, value in metadata or ()
        if key == AUTH_KEY
    }
    if len(values) > 1:
        raise ConflictingCredentials("conflicting authorization headers")
    return next(iter(values), None)


def _bearer_bytes(token: str | None) -> bytes | None:
    """The `authorization` value that proves `token`, as UTF-8 bytes (None: not configured)."""
    return f"Bearer {token}".encode("utf-8", "surrogatepass") if token else None


def _matches(got: str | None, want: bytes | None) -> bool:
    # Compared as UTF-8 bytes: hmac.compare_digest raises TypeError on a non-ASCII str, which
    # would end a caller's call UNKNOWN instead of refusing it (or break a non-ASCII token).
    if want is None or got is None:
        return False
    return hmac.compare_digest(got.encode("utf-8", "surrogatepass"), want)


@dataclass(frozen=True)
class AuthPolicy:
    """The credentials one server accepts (None = not configured)."""

    token: str | None = None
    admin_token: str | None = None

    @property
    def open(self) -> bool:
        """True when no credential is configured (every caller is an operator)."""
        return not self.token and not self.admin_token

    @cached_property
    def _bearer(self) -> bytes | None:
        # Built once per policy, not on every call (this check runs on every RPC).
        return _bearer_bytes(self.token)

    @cached_property
    def _admin_bearer(self) -> bytes | None:
        return _bearer_bytes(self.admin_token)

    def role(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> CallerRole | None:
        """The caller's role from its call metadata; None when it proved nothing it must.

        Raises ConflictingCredentials for two distinct `authorization` values.
        """
        got = _bearer(metadata)
        if _matches(got, self._admin_bearer):
            return CallerRole.ADMIN
        if self.open:
            return CallerRole.ADMIN
        if not self.token:  # only an admin token: anyone may register and read
            return CallerRole.INSTANCE
        return CallerRole.INSTANCE if _matches(got, self._bearer) else None

    def is_admin(self, context: Any) -> bool:
        """True when the call of `context` (sync or asyncio ServicerContext) is an operator's."""
        try:
            return self.role(context.invocation_metadata()) is CallerRole.ADMIN
        except ConflictingCredentials:
            return False


#: Status and message of a refused admin operation (the caller did authenticate).
ADMIN_REQUIRED = (
    grpc.StatusCode.PERMISSION_DENIED,
    "this operation needs the admin token (--admin-token / PDPLANE_ADMIN_TOKEN) or the "
    "instance's own lease id",
)


class InsecureBindError(ValueError):
    """A service would listen on a non-loopback address without a token."""


def is_loopback(host: str) -> bool:
    """True for addresses only this machine reaches: 127.0.0.0/8, ::1, "localhost"."""
    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name may resolve anywhere


def check_bind(service: str, host: str, token: str | None, insecure: bool) -> None:
    """Protected mode: refuses a non-loopback `host` without `token` unless `insecure`.

    Raises InsecureBindError naming the fix (the precedent is Redis's protected mode).
    """
    if token or insecure or is_loopback(host):
        return
    raise InsecureBindError(
        f"{service}: refusing to listen on {host} without a token: anyone who reaches it could "
        "register, drain or read instances. Set --token (PDPLANE_TOKEN), listen on 127.0.0.1, "
        "or pass --insecure to accept that"
    )
