"""The credentials of a fleet started on this machine (`pdplane up`), kept for its local tools.

`pdplane up` generates a shared token and an admin token (`generate`), hands them to the
processes it starts through their environment (`PDPLANE_TOKEN`; `PDPLANE_ADMIN_TOKEN` to the
registry only), never their argv (which `ps` shows), and writes them with the registry's
address to `credentials_path()` (mode 0600, in a 0700 folder). `pdplane ls`, `pdplane drain`,
`pdplane vllm`, `pdplane grpc` and `pdplane plan --registry` read that file (`token_for`) when
they talk to that registry, or (the shared token only) to another gRPC service of the fleet that
it lists (the scheduler, the instances' KvTransfer endpoints), and were not given a token, so
nothing has to be typed. The admin token goes to the registry alone, the only service that
checks it.

File format (JSON): {"registry": "127.0.0.1:8051", "token": "...", "admin_token": "...",
"services": ["127.0.0.1:8052", ...]} ("services" absent in files of older versions: none).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from pdplane.core import defaults
from pdplane.core.token_file import new_token

__all__ = [
    "FleetCredentials",
    "credentials_path",
    "for_address",
    "for_registry",
    "generate",
    "local",
    "remove",
    "token_for",
    "write",
]

_FILE = "fleet-credentials.json"


def credentials_path() -> Path:
    """$PDPLANE_CACHE_DIR/fleet-credentials.json, else ~/.cache/pdplane/fleet-credentials.json."""
    return defaults.cache_root() / _FILE


@dataclass(frozen=True)
class FleetCredentials:
    """A fleet's registry address ("host:port"), its two bearer tokens, and the addresses of
    its other gRPC services ("host:port" each) that take the shared token."""

    registry: str
    token: str
    admin_token: str
    services: tuple[str, ...] = ()
    scheduler: str = ""  # its scheduler's gRPC address (also in `services`); "" = unknown


def generate(registry: str, services: tuple[str, ...] = ()) -> FleetCredentials:
    """Fresh tokens (`token_file.new_token`: 256 random bits each) for the fleet at `registry`
    whose other gRPC services listen at `services`."""
    return FleetCredentials(registry, new_token(), new_token(), tuple(services))


def write(creds: FleetCredentials, path: Path | None = None) -> Path:
    """Writes `creds` to `path` (default `credentials_path()`), readable by this user only;
    returns the path. Raises OSError when the folder cannot be made or written."""
    target = path or credentials_path()
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({**asdict(creds), "services": list(creds.services)}, out)
    os.replace(tmp, target)  # readers never see a half-written file
    return target


def _read(path: Path) -> FleetCredentials | None:
    try:
        data = json.loads(path.read_text())
        services = data.get("services") or []
        if not isinstance(services, list):
            return None
        return FleetCredentials(
            str(data["registry"]),
            str(data["token"]),
            str(data["admin_token"]),
            tuple(str(a) for a in services),
            str(data.get("scheduler") or ""),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def local(path: Path | None = None) -> FleetCredentials | None:
    """The local fleet's credentials (`path`, default `credentials_path()`); None when there is
    no readable file."""
    return _read(path or credentials_path())


def _addresses(address: str) -> set[str]:
    return {a.strip() for a in address.split(",")}


def for_registry(registry: str, path: Path | None = None) -> FleetCredentials | None:
    """The local fleet's credentials when `registry` (one address or comma-separated replicas)
    names its registry; None when there is no (readable) file or it is another fleet's."""
    creds = _read(path or credentials_path())
    if creds is None:
        return None
    return creds if creds.registry in _addresses(registry) else None


def for_address(address: str, path: Path | None = None) -> FleetCredentials | None:
    """The local fleet's credentials when `address` (one or comma-separated "host:port") names
    its registry or one of its other gRPC services; None otherwise (or without a file)."""
    creds = _read(path or credentials_path())
    if creds is None:
        return None
    ours = {creds.registry, *creds.services}
    return creds if _addresses(address) & ours else None


def token_for(address: str, token: str | None, *, admin: bool = False) -> str | None:
    """The token a local tool sends to `address`: `token` when given (non-empty), else the
    local fleet's shared token when `address` names one of its gRPC services (`for_address`),
    or with `admin` its admin token when `address` names its registry; else None (no token)."""
    if token:
        return token
    local = for_registry(address) if admin else for_address(address)
    if local is None:
        return None
    return local.admin_token if admin else local.token


def remove(creds: FleetCredentials, path: Path | None = None) -> None:
    """Deletes the file when it still holds `creds` (a later fleet's file is left alone)."""
    target = path or credentials_path()
    if _read(target) == creds:
        target.unlink(missing_ok=True)
