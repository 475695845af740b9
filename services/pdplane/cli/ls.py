"""`pdplane ls`: list the registry's instances (a table, or `--json`), or `--watch` its events.

    pdplane ls [--registry HOST:PORT[,HOST:PORT...]] [--role prefill|decode|both] [--model M]
               [--scheduler HOST:PORT | --scheduler ""] [--json]
    pdplane ls --watch [--json]        # one line per event until interrupted

With several registry replicas, the first that answers is used; a broken watch moves to the
next one and continues from its last revision.

TOKENIZER is the content hash of the tokenizer and chat template the instance publishes to
gateways (`-` = none; JSON: `tokenizer_hash`): instances of one model that show different
hashes make the gateway route that model by load only (its /health says so).

The KV_INDEX column (JSON: `kv_index`) is the scheduler's prefix index's state of each instance
(`Scheduler.ListKvStates`, docs/kv_events.md): `live` (its cache is used for routing), `syncing`
(no snapshot yet), `stale` (stream down or lagging: routed by load), `-` (not followed: no
KV endpoint), `off` (the scheduler has no index), `?` (the scheduler did not answer; the
reason goes to stderr and the listing still succeeds). The registry does not hold it: each
scheduler replica has its own index, and `--scheduler` picks the one to ask (default: the local
`pdplane up` fleet's scheduler when `--registry` is its registry, else the port `pdplane up`
gives it by default; `--scheduler ""` leaves the column out).

Exit codes: 0 success, 1 registry unreachable or refused the call, 2 bad flags.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterable
from typing import Any, Literal, TextIO

import grpc
from pydantic import Field

from pdplane.cli import fleet_credentials
from pdplane.cli.instance_json import event_to_dict, instance_to_dict, parse_role
from pdplane.core import defaults
from pdplane.core.grpc import util as grpc_util
from pdplane.core.settings import CommandSettings
from pdplane.core.token_file import token_file_field
from pdplane.registry.failover import FAILOVER_CODES, RegistryEndpoints, call_any
from pdplane.v1 import instance_pb2, registry_pb2, scheduler_pb2, scheduler_pb2_grpc

__all__ = ["LsSettings", "format_table", "main"]


class LsSettings(CommandSettings):
    """Flags of `pdplane ls` (each also a `PDPLANE_*` environment variable)."""

    registry: str = Field(
        f"127.0.0.1:{defaults.REGISTRY_PORT}",
        description="registry gRPC address host:port, or several replicas' comma-separated",
    )
    role: Literal["prefill", "decode", "both"] | None = Field(
        None, description="only this role (a 'both' instance matches prefill and decode)"
    )
    model: str | None = Field(None, description="only this served model name")
    json_: bool = Field(False, alias="json", description="print JSON instead of a table")
    watch: bool = Field(False, description="stream ADDED/UPDATED/REMOVED events")
    token: str | None = Field(
        None,
        description="registry bearer token (default: the local `pdplane up` fleet's, if this is "
        "its registry)",
    )
    token_file: str | None = token_file_field("--token")
    tls_ca: str | None = Field(
        None, description="CA certificate (PEM) to verify the registry's and scheduler's TLS"
    )
    scheduler: str | None = Field(
        None,
        description="scheduler gRPC address whose prefix index fills KV_INDEX (default: the "
        f"local `pdplane up` fleet's if this is its registry, else 127.0.0.1:"
        f"{defaults.SCHEDULER_PORT}); '' = no column",
    )
    scheduler_token: str | None = Field(
        None, description="scheduler bearer token (default: --token)"
    )
    timeout_s: float = Field(5.0, gt=0, description="deadline of the list call (s)")


_COLUMNS = (
    "ID",
    "ROLE",
    "MODEL",
    "STATE",
    "URL",
    "KV_ENDPOINT",
    "RUN",
    "WAIT",
    "KV%",
    "FREE",
    "TOKENIZER",
)
#: Hex digits of a tokenizer's content hash shown (enough to tell tokenizers apart).
_HASH_DIGITS = 12
_KV_COLUMN = 4  # KV_INDEX goes after STATE


def _row(d: dict[str, Any], kv_column: bool) -> tuple[str, ...]:
    load = d["load"]
    kv: tuple[str, ...] = ()
    if kv_column:
        index = d.get("kv_index")
        kv = (index if isinstance(index, str) else index["state"] if index else "-",)
    return (
        d["id"],
        d["role"],
        d["model"],
        d["state"],
        *kv,
        d["url"],
        d["kv_endpoint"],
        str(load["num_running"]),
        str(load["num_waiting"]),
        f"{100 * load['kv_cache_usage']:.0f}",
        str(load["free_kv_blocks"]),
        d["tokenizer_hash"][: len("sha256:") + _HASH_DIGITS] or "-",
    )


def format_table(instances: Iterable[dict[str, Any]], *, kv_column: bool = False) -> str:
    """Aligned text table of `instance_to_dict` views, one line per instance plus a header;
    `kv_column` adds KV_INDEX from each view's `kv_index` (a `ListKvStates` entry as a dict,
    a marker string such as "?", or None = not followed)."""
    header: tuple[str, ...] = _COLUMNS
    if kv_column:
        header = (*_COLUMNS[:_KV_COLUMN], "KV_INDEX", *_COLUMNS[_KV_COLUMN:])
    rows = [header, *(_row(d, kv_column) for d in instances)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return (
        "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        )
        + "\n"
    )


def _matches(
    instance: instance_pb2.Instance, role: instance_pb2.Role.ValueType, model: str | None
) -> bool:
    spec = instance.spec
    if role and spec.role not in (role, instance_pb2.ROLE_BOTH):
        return False
    return not model or spec.model == model


def _list(
    endpoints: RegistryEndpoints,
    s: LsSettings,
    role: instance_pb2.Role.ValueType,
    out: TextIO,
) -> None:
    request = registry_pb2.ListInstancesRequest(role=role, model=s.model or "")
    metadata = grpc_util.token_metadata(s.token)
    # The streamed form: a fleet too large for one 64 MiB message still lists.
    parts = call_any(
        endpoints,
        lambda stub: list(
            stub.ListInstancesStream(request, timeout=s.timeout_s, metadata=metadata)
        ),
    )
    views = [instance_to_dict(i) for part in parts for i in part.instances]
    if s.scheduler:
        states = _kv_states(s, s.scheduler)
        for v in views:
            v["kv_index"] = states.get(v["id"]) if isinstance(states, dict) else states
    text = format_table(views, kv_column=bool(s.scheduler))
    out.write(json.dumps(views, indent=2) + "\n" if s.json_ else text)


def _kv_states(s: LsSettings, scheduler: str) -> dict[str, dict[str, Any]] | str:
    """instance id -> its prefix index state (a dict of `KvIndexState`'s fields), or a marker
    for every row: "off" (no index there), "?" (no answer; the reason goes to stderr)."""
    metadata = grpc_util.token_metadata(s.scheduler_token or s.token)
    try:
        with grpc_util.channel(scheduler, s.tls_ca) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            response = stub.ListKvStates(
                scheduler_pb2.ListKvStatesRequest(), timeout=s.timeout_s, metadata=metadata
            )
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        if code is grpc.StatusCode.FAILED_PRECONDITION:
            return "off"
        details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        name = code.name if code is not None else "UNKNOWN"
        sys.stderr.write(f"pdplane ls: scheduler {scheduler}: {name}: {details} (KV_INDEX ?)\n")
        return "?"
    return {
        st.instance_id: {
            "state": st.state,
            "reason": st.reason,
            "blocks": st.blocks,
            "lag_events": st.lag_events,
            "last_message_age_ms": st.last_message_age_ms,
            "snapshots": st.snapshots,
        }
        for st in response.instances
    }


def _event_line(event: registry_pb2.WatchEvent) -> str:
    kind = registry_pb2.WatchEvent.Type.Name(event.type)
    if event.type == registry_pb2.WatchEvent.SNAPSHOT:
        return f"{event.revision} SNAPSHOT {len(event.instances)} instance(s)\n" + format_table(
            instance_to_dict(i) for i in event.instances
        )
    d = instance_to_dict(event.instance)
    reason = f" ({event.reason})" if event.reason else ""
    return f"{event.revision} {kind} {d['id']} {d['role']} {d['model']} {d['state']}{reason}\n"


class _Stream:
    """The watch stream in use, cancellable from another thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._call: Any = None
        self._stopped = threading.Event()
        self.cancelled = False

    def pause(self, seconds: float) -> None:
        """Waits `seconds`, or less when cancelled meanwhile."""
        self._stopped.wait(seconds)

    def open(self, call: Any) -> Any:
        """Makes `call` the current stream (cancelled at once after `cancel`); returns it."""
        with self._lock:
            self._call = call
            if self.cancelled:
                call.cancel()
        return call

    def cancel(self) -> None:
        """Cancels the current stream and any opened later."""
        with self._lock:
            self.cancelled = True
            self._stopped.set()
            if self._call is not None:
                self._call.cancel()


def _watch(
    endpoints: RegistryEndpoints,
    s: LsSettings,
    role: instance_pb2.Role.ValueType,
    out: TextIO,
) -> None:
    """Follows the watch on a thread of its own; Ctrl-C cancels the stream and raises
    KeyboardInterrupt here. The main thread only waits: a KeyboardInterrupt raised inside
    gRPC's own code while a call is open can deadlock the channel's close (grpc/grpc#19973;
    `pdplane ls --watch` once did not exit within 60 s of SIGINT on a busy host)."""
    stream = _Stream()
    failed: list[BaseException] = []

    def follow() -> None:
        try:
            _follow(endpoints, s, role, out, stream)
        except BaseException as exc:  # handed to the main thread
            failed.append(exc)

    thread = threading.Thread(target=follow, name="pdplane-ls-watch", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.5)
    except KeyboardInterrupt:
        stream.cancel()
        thread.join(5.0)
        raise
    if failed:
        raise failed[0]


#: the pause before the watch asks every replica again after all of them broke (s), doubled
#: per round up to the last
_RETRY_S = (0.2, 0.4, 0.8, 1.6, 2.0)


def _follow(
    endpoints: RegistryEndpoints,
    s: LsSettings,
    role: instance_pb2.Role.ValueType,
    out: TextIO,
    stream: _Stream,
) -> None:
    """Writes the watch's events to `out` until cancelled. Replicas that break are failed
    over; when every one broke, the watch raises the last error if none ever answered (a
    wrong address fails fast), else it says so on stderr once and asks again (pauses of
    `_RETRY_S`) until one answers: a registry restarted under a watch is followed, and its
    new snapshot printed."""
    revision = 0
    failures = 0  # replicas in a row that broke without sending anything
    followed = False  # some replica answered: losing every one is an outage, not a typo
    rounds = 0  # rounds of every replica broken, since one last answered
    while not stream.cancelled:
        request = registry_pb2.WatchInstancesRequest(from_revision=revision)
        try:
            for event in stream.open(
                endpoints.stub.WatchInstances(request, metadata=grpc_util.token_metadata(s.token))
            ):
                if rounds:
                    sys.stderr.write(f"pdplane ls: registry {endpoints.address} answers again\n")
                failures, followed, rounds = 0, True, 0
                if event.revision <= revision and event.type != registry_pb2.WatchEvent.SNAPSHOT:
                    continue  # replayed by the next replica
                revision = event.revision
                if event.type == registry_pb2.WatchEvent.SNAPSHOT:
                    kept = [i for i in event.instances if _matches(i, role, s.model)]
                    del event.instances[:]
                    event.instances.extend(kept)
                elif not _matches(event.instance, role, s.model):
                    continue
                out.write(
                    json.dumps(event_to_dict(event)) + "\n" if s.json_ else _event_line(event)
                )
                out.flush()
            return
        except grpc.RpcError as exc:
            if stream.cancelled:
                return
            code = exc.code() if isinstance(exc, grpc.Call) else None
            failures += 1
            if code not in FAILOVER_CODES:
                raise
            if failures < len(endpoints.addresses):
                endpoints.failover()
                continue
            if not followed:
                raise
            if not rounds:
                name = code.name if code is not None else "UNKNOWN"
                which = (
                    f"every registry replica ({', '.join(endpoints.addresses)})"
                    if endpoints.several
                    else f"registry {endpoints.address}"
                )
                sys.stderr.write(f"pdplane ls: {which} broke off ({name}); reconnecting\n")
            stream.pause(_RETRY_S[min(rounds, len(_RETRY_S) - 1)])
            rounds += 1
            failures = 0
            endpoints.failover()


def main(argv: list[str], out: TextIO | None = None) -> int:
    """Runs `pdplane ls`; writes to `out` (stdout by default) and returns the exit code."""
    settings = LsSettings.parse(argv)
    # The local `pdplane up` fleet's token when none was given: nothing to type.
    settings.token = fleet_credentials.token_for(settings.registry, settings.token)
    if settings.scheduler is None:  # the local fleet's, wherever `pdplane up` put it
        local = fleet_credentials.for_registry(settings.registry)
        default = f"127.0.0.1:{defaults.SCHEDULER_PORT}"
        settings.scheduler = local.scheduler if local and local.scheduler else default
    out = out or sys.stdout
    role = parse_role(settings.role) if settings.role else instance_pb2.ROLE_UNSPECIFIED
    # The registration client's reconnect backoff (capped at 0.5 s), not gRPC's (up to 120
    # s): a watch that lost its registry for a minute would otherwise see it back a minute
    # or two late.
    endpoints = RegistryEndpoints(
        settings.registry, settings.tls_ca, grpc_util.FAST_RECONNECT_OPTIONS
    )
    try:
        try:
            if settings.watch:
                _watch(endpoints, settings, role, out)
            else:
                _list(endpoints, settings, role, out)
        except grpc.RpcError as exc:
            status = exc.code() if isinstance(exc, grpc.Call) else None
            code = status.name if status is not None else "UNKNOWN"
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            where = f"registry {endpoints.address}"
            if endpoints.several and status in FAILOVER_CODES:  # every replica was tried
                tried = ", ".join(endpoints.addresses)
                where = f"every registry replica ({tried}); the last, {endpoints.address}"
            hint = ""
            if status == grpc.StatusCode.UNAUTHENTICATED and not settings.token:
                hint = f" ({fleet_credentials.unauthenticated_hint(settings.registry)})"
            sys.stderr.write(f"pdplane ls: {where}: {code}: {details}{hint}\n")
            return 1
        except KeyboardInterrupt:
            return 0
    finally:
        endpoints.close()
    return 0
