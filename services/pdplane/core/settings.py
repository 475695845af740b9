"""Typed command settings: every field is a `--kebab-case` flag and a `PDPLANE_*` env var.

Built on pydantic-settings' CLI support, so flags, environment and defaults are parsed and
validated in one place (precedence: flag > environment > default). A token setting `<name>`
with a `<name>_file` companion is read from that file when it is empty
(`pdplane.core.token_file`).
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Annotated, Any, Self

from pydantic import AfterValidator, ValidationError, model_validator
from pydantic_settings import BaseSettings, CliApp, CliSettingsSource, SettingsConfigDict

from pdplane.core.token_file import resolve_token_files

__all__ = ["CommandSettings", "LogLevel"]


def _log_level(name: str) -> str:
    if name.upper() not in logging.getLevelNamesMapping():
        raise ValueError(f"unknown logging level {name!r} (DEBUG, INFO, WARNING, ERROR, CRITICAL)")
    return name


#: A Python logging level by name, in any case ("info", "WARNING"); others are refused.
LogLevel = Annotated[str, AfterValidator(_log_level)]


class _HelpSource(CliSettingsSource[Any]):
    """pydantic-settings' CLI source, with help that says each default once, in words.

    pydantic-settings appends "(default: X)" to every option's description; where the
    description already says what the default is ("(default: a tiny Llama built locally)") that
    is a second default, and for None or "" it reads "(default: null)" or "(default: )"."""

    def _help_format(self, *args: Any, **kwargs: Any) -> str:
        text = super()._help_format(*args, **kwargs)
        field_info = kwargs.get("field_info", args[1] if len(args) > 1 else None)
        said = (getattr(field_info, "description", None) or "").replace("%", "%%")
        if not text.startswith(said):
            return text
        tail = text[len(said) :]
        if "(default:" in said:
            tail = _APPENDED_DEFAULT.sub("", tail, count=1)
        else:
            tail = tail.replace("(default: null)", "(default: unset)")
            tail = tail.replace("(default: )", "(default: empty)")
        return said + tail


#: The default pydantic-settings appends to an option's description.
_APPENDED_DEFAULT = re.compile(r" ?\(default(?: factory)?: [^()]*\)")


class CommandSettings(BaseSettings):
    """Base class of every command's settings. Subclasses add fields with descriptions."""

    model_config = SettingsConfigDict(
        env_prefix="PDPLANE_",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_exit_on_error=True,
        # `--model Path`, not `--model {Path,null}`: no flag takes "null" from a user.
        cli_hide_none_type=True,
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
        source: CliSettingsSource[Self] = _HelpSource(cls, cli_prog_name=name)
        try:
            return CliApp.run(cls, cli_args=argv, cli_settings_source=source)
        except ValidationError as exc:
            for err in exc.errors():
                flag = "-".join(str(p) for p in err["loc"]).replace("_", "-")
                where = f"--{flag}: " if flag else ""
                got = f" (got {err['input']!r})" if flag and "input" in err else ""
                # A validator's own ValueError reads as its message, without pydantic's prefix
                # and without the command's name when the message already starts with it.
                msg = err["msg"].removeprefix("Value error, ").removeprefix(f"{name}: ")
                sys.stderr.write(f"error: {name}: {where}{msg}{got}\n")
            raise SystemExit(2) from None
