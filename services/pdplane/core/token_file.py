"""Bearer tokens kept in files: read at start (`--token-file`), written once (`pdplane tokens`).

A deployment that cannot pass a secret by environment at creation time (docker compose from a
clean clone: nothing for the user to type) generates the tokens into a volume once and points
every service at the files. Precedence, for every `<name>` token setting that has a
`<name>_file` companion: a non-empty `--<name>` / `PDPLANE_<NAME>` wins; otherwise the file's
content (surrounding whitespace stripped); otherwise no token. An empty environment variable
(an unset compose substitution) therefore never hides the file.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

__all__ = [
    "MAX_TOKEN_BYTES",
    "ensure_token",
    "new_token",
    "read_token",
    "resolve_token_files",
    "token_file_field",
]


def new_token() -> str:
    """A fresh bearer token: 256 random bits as 64 hex digits.

    Hex, not URL-safe base64: a token that starts with "-" (1 in 64 of `token_urlsafe`'s)
    breaks `--token "$T"` on every command line (argparse takes it for an option).
    """
    return secrets.token_hex(32)


#: A token file larger than this is a wrong path (a log, a binary), not a token.
MAX_TOKEN_BYTES = 4096


def read_token(path: str | Path) -> str:
    """The token in `path`, surrounding whitespace stripped.

    Raises ValueError naming the path when it cannot be read, is empty, is larger than
    MAX_TOKEN_BYTES or is not UTF-8 text.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read token file {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_TOKEN_BYTES:
        raise ValueError(f"token file {path} is larger than {MAX_TOKEN_BYTES} bytes")
    try:
        token = raw.decode().strip()
    except UnicodeDecodeError:
        raise ValueError(f"token file {path} is not UTF-8 text") from None
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def ensure_token(path: str | Path) -> bool:
    """Writes a fresh token (256 random bits, URL-safe text) to `path` unless it already holds
    one; returns True when it wrote. The file is mode 0600 and appears whole or not at all
    (written aside, then hard-linked into place, so two racing writers keep the first).

    Raises OSError when the folder is not writable; ValueError when `path` exists but holds
    no valid token (an empty or broken file is never silently replaced: say so).
    """
    target = Path(path)
    if target.exists():
        read_token(target)
        return False
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(new_token() + "\n")
        try:
            os.link(tmp, target)
        except FileExistsError:
            return False
    finally:
        tmp.unlink(missing_ok=True)
    return True


def resolve_token_files(data: Any, fields: dict[str, Any]) -> Any:
    """For settings input `data` (a dict of field name -> value): fills every empty `<name>`
    from `<name>_file` when both are fields of the model (see the module's precedence).

    Raises ValueError from `read_token`. Non-dict input is returned unchanged.
    """
    if not isinstance(data, dict):
        return data
    for name in fields:
        path = data.get(f"{name}_file")
        if name.endswith("token") and f"{name}_file" in fields and path and not data.get(name):
            data[name] = read_token(path)
    return data


def token_file_field(flag: str) -> Any:
    """The pydantic Field of `<name>_file`, the companion of the token setting `flag`."""
    from pydantic import Field

    return Field(None, description=f"file holding {flag} (read at start; a non-empty {flag} wins)")
