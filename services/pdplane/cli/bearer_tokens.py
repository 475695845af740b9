"""`pdplane tokens`: write random bearer tokens into files once (a deployment's init step).

    pdplane tokens --token-file /run/pdplane/fleet/token \
        --admin-token-file /run/pdplane/admin/token

Each file that does not exist yet gets a fresh token (256 random bits, mode 0600); one that
holds a token is kept, so running it again (every `docker compose up`) changes nothing. The
services then read them with their own `--token-file` / `--admin-token-file`. Tokens are never
printed. Exit codes: 0 done, 1 a file could not be written or holds no valid token, 2 bad
flags.
"""

from __future__ import annotations

import sys

from pydantic import Field

from pdplane.core.settings import CommandSettings
from pdplane.core.token_file import ensure_token

__all__ = ["TokensSettings", "main"]


class TokensSettings(CommandSettings):
    """Flags of `pdplane tokens` (each also a `PDPLANE_*` environment variable)."""

    token_file: str = Field(description="file of the shared token (instances, services)")
    admin_token_file: str | None = Field(None, description="file of the operators' admin token")


def main(argv: list[str]) -> int:
    """Runs `pdplane tokens`; returns the exit code."""
    s = TokensSettings.parse(argv, prog="pdplane tokens")
    for path in filter(None, (s.token_file, s.admin_token_file)):
        try:
            wrote = ensure_token(path)
        except (OSError, ValueError) as exc:
            sys.stderr.write(f"pdplane tokens: {path}: {exc}\n")
            return 1
        sys.stdout.write(f"{'wrote a new token to' if wrote else 'kept the token in'} {path}\n")
    return 0
