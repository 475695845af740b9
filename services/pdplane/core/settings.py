"""Typed command settings: every field is a `--kebab-case` flag and a `PDPLANE_*` env var.

Built on pydantic-settings' CLI support, so flags, environment and defaults are parsed and
validated in one place (precedence: flag > environment > default).
"""

from __future__ import annotations

import sys
from typing import Self

from pydantic import ValidationError
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict

__all__ = ["CommandSettings"]


class CommandSettings(BaseSettings):
    """Base class of every command's settings. Subclasses add fields with descriptions."""

    model_config = SettingsConfigDict(
        env_prefix="PDPLANE_",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_exit_on_error=True,
        extra="ignore",
    )

    @classmethod
    def parse(cls, argv: list[str]) -> Self:
        """Parses `argv` (flags) over `PDPLANE_*` environment variables and defaults.

        Exits with status 2 and a usage message on unknown flags or invalid values.
        """
        try:
            return CliApp.run(cls, cli_args=argv)
        except ValidationError as exc:
            for err in exc.errors():
                name = "-".join(str(p) for p in err["loc"]).replace("_", "-")
                sys.stderr.write(f"error: --{name}: {err['msg']} (got {err.get('input')!r})\n")
            raise SystemExit(2) from None
