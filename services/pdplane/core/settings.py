"""Typed command settings: every field is a `--kebab-case` flag and a `PDPLANE_*` env var.

Built on pydantic-settings' CLI support, so flags, environment and defaults are parsed and
validated in one place (precedence: flag > environment > default). A token setting `<name>`
with a `<name>_file` companion is read from that file when it is empty
(`pdplane.core.token_file`).
"""

from __future__ import annotations

import sys
from typing import Any, Self

from pydantic import ValidationError, model_validator
from pydantic_settings import BaseSettings, CliApp, CliSettingsSource, SettingsConfigDict

from pdplane.core.token_file import resolve_token_files

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

    @model_validator(mode="before")
    @classmethod
    def _token_files(cls, data: Any) -> Any:
        # Before the subclasses' checks (protected mode looks at the token).
        return resolve_token_files(data, cls.model_fields)

    @classmethod
    def parse(cls, argv: list[str], prog: str | None = None) -> Self:
        """Parses `argv` (flags) over `PDPLANE_*` environment variables and defaults.

        `prog` names the command in usage lines (default: "pdplane <command>" guessed from the
        class name, e.g. RegistrySettings -> "pdplane registry"). Exits with status 2 and a
        usage message on unknown flags or invalid values.
        """
        name = prog or f"pdplane {cls.__name__.removesuffix('Settings').lower()}"
        source: CliSettingsSource[Self] = CliSettingsSource(cls, cli_prog_name=name)
        try:
            return CliApp.run(cls, cli_args=argv, cli_settings_source=source)
        except ValidationError as exc:
            for err in exc.errors():
                flag = "-".join(str(p) for p in err["loc"]).replace("_", "-")
                where = f"--{flag}: " if flag else ""
                got = f" (got {err['input']!r})" if flag and "input" in err else ""
                sys.stderr.write(f"error: {name}: {where}{err['msg']}{got}\n")
            raise SystemExit(2) from None
