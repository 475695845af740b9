"""The credentials of the fleets started on this machine (`pdplane up`), kept for local tools.

`pdplane up` generates a shared token and an admin token (`generate`), hands them to the
processes it starts through their environment (`PDPLANE_TOKEN`; `PDPLANE_ADMIN_TOKEN` to the
registry only), never their argv (which `ps` shows), and writes them with the registry's
address to a file of that fleet's own, `fleets/<registry address>.json` under the cache root,
and to `credentials_path()`, which names the fleet started last (the one a script reads with
`jq -r .token`); all mode 0600 in 0700 folders. `pdplane ls`, `pdplane drain`, `pdplane vllm`,
`pdplane grpc` and `pdplane plan --registry` look an address up among those files (`token_for`)
when they talk to a fleet's registry, or (the shared token only) to another gRPC service of the
fleet that it lists (the scheduler, the instances' KvTransfer endpoints), and were not given a
token, so nothing has to be typed, however many fleets run side by side. A file whose
`pdplane up` process is gone (killed before it could remove it) is ignored and pruned. "localhost"
and 127.0.0.1 name the same address. The admin token goes to the registry alone, the only
service that checks it.

File format (JSON): {"registry": "127.0.0.1:8051", "token": "...", "admin_token": "...",
"services": ["127.0.0.1:8052", ...], "scheduler": "127.0.0.1:8052", "pid": 1234} ("services"
and "pid" absent in files of older versions: none, and taken as running).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from pdplane.core import defaults
from pdplane.core.token_file import new_token

__all__ = [
    "FleetCredentials",
    "credentials_path",
    "fleet_path",
    "for_address",
    "for_registry",
    "generate",
    "local",
    "remove",
    "token_for",
    "unauthenticated_hint",
    "write",
]

_FILE = "fleet-credentials.json"
_FLEETS = "fleets"


def credentials_path() -> Path:
    """The file of the fleet started last: $PDPLANE_CACHE_DIR/fleet-credentials.json, else
    ~/.cache/pdplane/fleet-credentials.json. Each running fleet also has its own file in the
    `fleets` folder beside it (named by its registry's address)."""
    return defaults.cache_root() / _FILE


def _fleet_path(main: Path, registry: str) -> Path:
    """The file of the fleet whose registry is `registry` ("host:port"), beside `main`."""
    return main.parent / _FLEETS / (re.sub(r"[^A-Za-z0-9.-]", "_", registry) + ".json")


def fleet_path(creds: FleetCredentials, path: Path | None = None) -> Path:
    """The fleet's own file ("fleets/127.0.0.1_8051.json" beside `path`, default
    `credentials_path()`)."""
    return _fleet_path(path or credentials_path(), creds.registry)


@dataclass(frozen=True)
class FleetCredentials:
    """A fleet's registry address ("host:port"), its two bearer tokens, and the addresses of
    its other gRPC services ("host:port" each) that take the shared token."""

    registry: str
    token: str
    admin_token: str
    services: tuple[str, ...] = ()
    scheduler: str = ""  # its scheduler's gRPC address (also in `services`); "" = unknown
    pid: int = 0  # its `pdplane up` process; 0 = unknown (taken as running)

    @property
    def running(self) -> bool:
        """Whether its `pdplane up` process still exists (True when unknown)."""
        if self.pid <= 0:
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process: it exists
            return True
        return True


def generate(registry: str, services: tuple[str, ...] = ()) -> FleetCredentials:
    """Fresh tokens (`token_file.new_token`: 256 random bits each) for the fleet at `registry`
    whose other gRPC services listen at `services`, run by this process."""
    return FleetCredentials(registry, new_token(), new_token(), tuple(services), pid=os.getpid())


def _write_one(creds: FleetCredentials, target: Path) -> None:
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({**asdict(creds), "services": list(creds.services)}, out)
    os.replace(tmp, target)  # readers never see a half-written file


def write(creds: FleetCredentials, path: Path | None = None) -> Path:
    """Writes `creds` to the fleet's own file and to `path` (default `credentials_path()`,
    the fleet started last), readable by this user only; returns `path`. A file an earlier run
    on the same registry address left is replaced. Raises OSError when a folder cannot be made
    or a file written."""
    target = path or credentials_path()
    _write_one(creds, _fleet_path(target, creds.registry))
    _write_one(creds, target)
    for file in _fleet_files(target):  # the files of fleets killed before their cleanup
        old = _read(file)
        if old is not None and not old.running:
            file.unlink(missing_ok=True)
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
            int(data.get("pid") or 0),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def local(path: Path | None = None) -> FleetCredentials | None:
    """The credentials of the running local fleet started last (`path`, default
    `credentials_path()`, else the newest other running fleet's file); None when none."""
    known = _known(path)
    return known[0] if known else None


def _fleet_files(main: Path) -> list[Path]:
    """The fleets' own files beside `main`, newest first."""
    try:
        return sorted(
            (main.parent / _FLEETS).glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True
        )
    except OSError:  # a file removed while listed: that fleet has stopped
        return []


def _known(path: Path | None) -> list[FleetCredentials]:
    """Every running local fleet's credentials: the fleet started last first, then the others
    (their own files, newest first)."""
    main = path or credentials_path()
    found: list[FleetCredentials] = []
    for creds in [_read(main), *(_read(f) for f in _fleet_files(main))]:
        if creds is not None and creds.running and creds not in found:
            found.append(creds)
    return found


def _address(address: str) -> str:
    """`address` ("host:port") as the files name it: "localhost" is 127.0.0.1."""
    address = address.strip()
    return "127.0.0.1" + address[9:] if address.startswith("localhost:") else address


def _addresses(address: str) -> set[str]:
    return {_address(a) for a in address.split(",")}


def for_registry(registry: str, path: Path | None = None) -> FleetCredentials | None:
    """The local fleet's credentials when `registry` (one address or comma-separated replicas)
    names its registry; None when there is no (readable) file or it is another fleet's."""
    wanted = _addresses(registry)
    return next((c for c in _known(path) if _address(c.registry) in wanted), None)


def for_address(address: str, path: Path | None = None) -> FleetCredentials | None:
    """The local fleet's credentials when `address` (one or comma-separated "host:port") names
    its registry or one of its other gRPC services; None otherwise (or without a file)."""
    wanted = _addresses(address)
    return next(
        (c for c in _known(path) if wanted & {_address(a) for a in (c.registry, *c.services)}),
        None,
    )


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
    """Deletes the fleet's files that still hold `creds` (a later run's are left alone); when
    `path` (default `credentials_path()`) was this fleet's or a fleet's no longer running, it
    then names the newest other fleet still running, if any."""
    target = path or credentials_path()
    own = _fleet_path(target, creds.registry)
    if _read(own) == creds:
        own.unlink(missing_ok=True)
    latest = _read(target)
    if latest is not None and (latest == creds or not latest.running):
        target.unlink(missing_ok=True)
        others = _known(target)
        if others:
            _write_one(others[0], target)


def unauthenticated_hint(
    address: str, flags: str = "--token or --token-file", path: Path | None = None
) -> str:
    """What to tell a user whose call to `address` was refused UNAUTHENTICATED (one line, no
    token in it): the registries of the fleets running here when `address` is none of theirs,
    and `flags`, the ones that give a token."""
    known = _known(path)
    if any(_addresses(address) & {_address(a) for a in (c.registry, *c.services)} for c in known):
        return f"the local fleet's token was sent and refused: pass {flags}"
    running = ", ".join(sorted(c.registry for c in known))
    here = f"; fleets started here by `pdplane up`: {running}" if running else ""
    return f"no token known for {address}: pass {flags}{here}"
