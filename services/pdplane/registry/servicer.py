"""`pdplane.v1.Registry`'s servicer: protobuf in, validate, call the store, protobuf out.

It serves a `grpc.aio` server (`pdplane.registry.server`). Errors are reported by setting the
status on the context rather than `abort`, so that one RPC's refusal never raises through the
handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeVar

import grpc

from pdplane.core.grpc.auth import ADMIN_REQUIRED, AuthPolicy
from pdplane.core.instance.validation import ValidationError, validate_load, validate_spec
from pdplane.registry.store import (
    AlreadyExistsError,
    InstanceStore,
    LeaseGrant,
    NotFoundError,
    StoreError,
    StoreUnavailableError,
)
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc

__all__ = ["SERVICE_NAME", "RegistryServicer", "public"]

SERVICE_NAME = "pdplane.v1.Registry"
#: Longest lease a client may ask for (ms); anything above is a mistake, not a wish.
MAX_REQUESTED_TTL_MS = 3_600_000
#: Bounds of a Register's request_id (characters): at least 32 (128 bits as hex digits; the
#: lease id derived from it is only as hard to guess as it is), at most 128 (bounds what the
#: registry hashes).
MIN_REQUEST_ID, MAX_REQUEST_ID = 32, 128

_R = TypeVar("_R")
_Event = registry_pb2.WatchEvent
#: Largest BATCH the registry sends, whatever a watcher asks for (bounds message size).
MAX_BATCH = 1024
#: Most heartbeats in one HeartbeatBatch (a host's relay sends one per instance on its host;
#: 4,096 load reports are ~400 KiB).
MAX_HEARTBEAT_BATCH = 4096
#: About the most bytes of one SNAPSHOT part (to watchers that accept parts) and of one
#: ListInstancesStream message: far below gRPC's 64 MiB limit, which 5,000 large specs (88 MB)
#: had outgrown. A part holds at least one instance (a spec is at most 8 KiB).
SNAPSHOT_PART_BYTES = 4 << 20
#: The registry's errors and their status, most specific first (any other StoreError: the
#: backing store refused for a reason of its own, INTERNAL with its message).
_STATUS: list[tuple[type[Exception], grpc.StatusCode]] = [
    (ValidationError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (StoreUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (StoreError, grpc.StatusCode.INTERNAL),
]
_ERRORS = (ValidationError, StoreError)
_MAX_DETAILS = 1000


def _status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    code = next(code for kind, code in _STATUS if isinstance(exc, kind))
    return code, str(exc)[:_MAX_DETAILS]


def _fail(context: Any, exc: Exception) -> None:
    code, details = _status(exc)
    context.set_code(code)
    context.set_details(details)


def _call(context: Any, empty: _R, fn: Callable[[], _R]) -> _R:
    """Runs `fn`, turning the registry's errors into a gRPC status on `context`."""
    try:
        return fn()
    except _ERRORS as exc:
        _fail(context, exc)
        return empty


async def _acall(context: Any, empty: _R, fn: Callable[[], Awaitable[_R]]) -> _R:
    """`_call` for coroutines."""
    try:
        return await fn()
    except _ERRORS as exc:
        _fail(context, exc)
        return empty


def _check_register(request: registry_pb2.RegisterRequest) -> None:
    if not request.HasField("spec"):
        raise ValidationError("spec", "is required")
    validate_spec(request.spec)
    if request.lease_ttl_ms > MAX_REQUESTED_TTL_MS:
        raise ValidationError(
            "lease_ttl_ms", f"must be at most {MAX_REQUESTED_TTL_MS}, got {request.lease_ttl_ms}"
        )
    size = len(request.request_id)
    if size and not MIN_REQUEST_ID <= size <= MAX_REQUEST_ID:
        raise ValidationError(
            "request_id",
            f"must be {MIN_REQUEST_ID}-{MAX_REQUEST_ID} characters (a random id), got {size}",
        )


def _registered(grant: LeaseGrant) -> registry_pb2.RegisterResponse:
    return registry_pb2.RegisterResponse(
        lease_id=grant.lease_id,
        lease_ttl_ms=grant.ttl_ms,
        heartbeat_interval_ms=grant.heartbeat_interval_ms,
        revision=grant.revision,
    )


def _check_heartbeat(request: registry_pb2.HeartbeatRequest) -> None:
    _require("instance_id", request.instance_id)
    _require("lease_id", request.lease_id)
    validate_load(request.load)


def _check_deregister(request: registry_pb2.DeregisterRequest) -> None:
    _require("instance_id", request.instance_id)


class _AdminRequired(Exception):
    """A lease-less Deregister from a caller without the admin credential."""


def public(instance: instance_pb2.Instance) -> instance_pb2.Instance:
    """A copy of `instance` without its lease id: the lease id is the instance's capability
    (who holds it may heartbeat, drain and deregister it), so no answer lists it."""
    out = instance_pb2.Instance()
    out.CopyFrom(instance)
    out.ClearField("lease_id")
    return out


def _pack(events: list[registry_pb2.WatchEvent], max_batch: int) -> list[registry_pb2.WatchEvent]:
    """Packs runs of consecutive change events into BATCH messages of at most `max_batch`
    events (order and revisions kept; SNAPSHOTs stay alone). `max_batch` <= 1: unchanged."""
    if max_batch <= 1 or len(events) <= 1:
        return events
    out: list[registry_pb2.WatchEvent] = []
    run: list[registry_pb2.WatchEvent] = []

    def flush() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            out.append(_Event(type=_Event.BATCH, revision=run[-1].revision, events=run))
        run.clear()

    for event in events:
        if event.type == _Event.SNAPSHOT:
            flush()
            out.append(event)
            continue
        run.append(event)
        if len(run) >= max_batch:
            flush()
    flush()
    return out


def _parts(instances: Iterable[instance_pb2.Instance]) -> Iterator[list[instance_pb2.Instance]]:
    """`instances` in order, cut into lists of about `SNAPSHOT_PART_BYTES` serialized bytes
    (at least one list, maybe empty)."""
    limit = SNAPSHOT_PART_BYTES
    part: list[instance_pb2.Instance] = []
    size = 0
    for instance in instances:
        n = instance.ByteSize() + 6  # field tag and length prefix
        if part and size + n > limit:
            yield part
            part, size = [], 0
        part.append(instance)
        size += n
    yield part


def _in_parts(events: list[registry_pb2.WatchEvent]) -> list[registry_pb2.WatchEvent]:
    """`events` with every SNAPSHOT over `SNAPSHOT_PART_BYTES` cut into parts of one revision,
    `more` set on all but the last."""
    if not any(e.type == _Event.SNAPSHOT for e in events):
        return events
    out: list[registry_pb2.WatchEvent] = []
    for event in events:
        if event.type != _Event.SNAPSHOT or event.ByteSize() <= SNAPSHOT_PART_BYTES:
            out.append(event)
            continue
        parts = list(_parts(event.instances))
        for i, part in enumerate(parts):
            more = i < len(parts) - 1
            out.append(
                _Event(type=_Event.SNAPSHOT, revision=event.revision, instances=part, more=more)
            )
    return out


def _outgoing(
    events: list[registry_pb2.WatchEvent], request: registry_pb2.WatchInstancesRequest
) -> list[registry_pb2.WatchEvent]:
    """What a watcher gets for `events`: packed as it asked (`max_batch`), snapshots in parts
    when it accepts them (`chunked_snapshots`)."""
    packed = _pack(events, min(request.max_batch, MAX_BATCH))
    return _in_parts(packed) if request.chunked_snapshots else packed


def _require(field: str, value: str) -> None:
    if not value:
        raise ValidationError(field, "must not be empty")


class RegistryServicer(registry_pb2_grpc.RegistryServicer):
    """The registry's asyncio servicer over an `InstanceStore` (validated input only reaches
    the store): reads run on the loop (they never block); mutations await the store's
    coroutines."""

    def __init__(
        self, store: InstanceStore, policy: AuthPolicy | None = None, coalesce_ms: int = 0
    ) -> None:
        self._store = store
        self._policy = policy or AuthPolicy()
        self._coalesce_s = coalesce_ms / 1000

    def _lease_for(self, request: registry_pb2.DeregisterRequest, context: Any) -> str:
        """The lease a Deregister acts on: the caller's own (`lease_id`, which proves it), or,
        for an operator (admin credential) that names none, the instance's live one."""
        _check_deregister(request)
        if request.lease_id:
            return request.lease_id
        if not self._policy.is_admin(context):
            raise _AdminRequired
        return self._store.get(request.instance_id).lease_id

    async def Register(  # type: ignore[override]
        self, request: registry_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.RegisterResponse:
        """Registers `request.spec`; see registry.proto for the errors."""

        async def run() -> registry_pb2.RegisterResponse:
            _check_register(request)
            admin = self._policy.is_admin(context)
            grant = await self._store.aregister(
                request.spec, request.lease_ttl_ms, request.lease_id, admin, request.request_id
            )
            return _registered(grant)

        return await _acall(context, registry_pb2.RegisterResponse(), run)

    async def _beat(self, request: registry_pb2.HeartbeatRequest) -> registry_pb2.HeartbeatResponse:
        _check_heartbeat(request)
        ttl_ms, state = await self._store.aheartbeat(
            request.instance_id, request.lease_id, request.load
        )
        return registry_pb2.HeartbeatResponse(lease_ttl_ms=ttl_ms, state=state)

    async def Heartbeat(  # type: ignore[override]
        self, request: registry_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.HeartbeatResponse:
        """Renews a lease with the load report; NOT_FOUND for an unknown lease."""
        return await _acall(context, registry_pb2.HeartbeatResponse(), lambda: self._beat(request))

    async def HeartbeatStream(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[registry_pb2.HeartbeatRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """One response per heartbeat; the first refusal ends the stream with its status (one
        suspended coroutine per open stream)."""
        # gRPC's reader/writer API (`request_iterator` unused): a heartbeat is one read and
        # one write, without the async generators an iterated stream puts around each message.
        try:
            while (request := await context.read()) is not grpc.aio.EOF:
                await context.write(await self._beat(request))
        except _ERRORS as exc:
            _fail(context, exc)

    async def _outcome(
        self, request: registry_pb2.HeartbeatRequest
    ) -> registry_pb2.HeartbeatOutcome:
        try:
            return registry_pb2.HeartbeatOutcome(response=await self._beat(request))
        except _ERRORS as exc:
            code, details = _status(exc)
            return registry_pb2.HeartbeatOutcome(code=code.value[0], details=details)

    async def HeartbeatBatchStream(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[registry_pb2.HeartbeatBatch],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """One HeartbeatBatchResponse per HeartbeatBatch, its outcomes in the batch's order;
        INVALID_ARGUMENT ends the stream for a batch over `MAX_HEARTBEAT_BATCH`."""
        while (batch := await context.read()) is not grpc.aio.EOF:
            if len(batch.heartbeats) > MAX_HEARTBEAT_BATCH:
                context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
                context.set_details(
                    f"heartbeats: {len(batch.heartbeats)} in one batch, at most "
                    f"{MAX_HEARTBEAT_BATCH}"
                )
                return
            # One after the other: each is a dictionary update in the steady state (a task per
            # heartbeat would cost more than the heartbeat); only an etcd replica taking an
            # instance over waits on the store, and then the batch waits with it.
            outcomes = [await self._outcome(request) for request in batch.heartbeats]
            await context.write(registry_pb2.HeartbeatBatchResponse(outcomes=outcomes))

    async def Deregister(  # type: ignore[override]
        self, request: registry_pb2.DeregisterRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.DeregisterResponse:
        """Removes (or with drain marks DRAINING) an instance; NOT_FOUND for a stale lease."""

        async def run() -> registry_pb2.DeregisterResponse:
            lease = self._lease_for(request, context)
            state = await self._store.aderegister(request.instance_id, lease, request.drain)
            return registry_pb2.DeregisterResponse(state=state)

        try:
            return await _acall(context, registry_pb2.DeregisterResponse(), run)
        except _AdminRequired:
            context.set_code(ADMIN_REQUIRED[0])
            context.set_details(ADMIN_REQUIRED[1])
            return registry_pb2.DeregisterResponse()

    async def ListInstances(  # type: ignore[override]
        self, request: registry_pb2.ListInstancesRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.ListInstancesResponse:
        """Instances matching role (BOTH matches either), model and state; zero = any."""

        def run() -> registry_pb2.ListInstancesResponse:
            instances, revision = self._listed(request)
            return registry_pb2.ListInstancesResponse(instances=instances, revision=revision)

        return _call(context, registry_pb2.ListInstancesResponse(), run)

    def _listed(
        self, request: registry_pb2.ListInstancesRequest
    ) -> tuple[list[instance_pb2.Instance], int]:
        if request.role not in instance_pb2.Role.values():
            raise ValidationError("role", f"unknown role {request.role}")
        if request.state not in instance_pb2.InstanceState.values():
            raise ValidationError("state", f"unknown state {request.state}")
        instances, revision = self._store.list(request.role, request.model, request.state)
        return [public(i) for i in instances], revision

    async def ListInstancesStream(  # type: ignore[override]
        self, request: registry_pb2.ListInstancesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[registry_pb2.ListInstancesResponse]:
        """ListInstances' list in messages of about `SNAPSHOT_PART_BYTES`, one revision."""
        try:
            instances, revision = self._listed(request)
        except _ERRORS as exc:
            _fail(context, exc)
            return
        for part in _parts(instances):
            yield registry_pb2.ListInstancesResponse(instances=part, revision=revision)

    async def GetInstance(  # type: ignore[override]
        self, request: registry_pb2.GetInstanceRequest, context: grpc.aio.ServicerContext
    ) -> instance_pb2.Instance:
        """One instance by id; NOT_FOUND for an unknown id."""

        def run() -> instance_pb2.Instance:
            _require("instance_id", request.instance_id)
            return public(self._store.get(request.instance_id))

        return _call(context, instance_pb2.Instance(), run)

    async def WatchInstances(  # type: ignore[override]
        self, request: registry_pb2.WatchInstancesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[registry_pb2.WatchEvent]:
        """SNAPSHOT (or replay), then every change; a slow stream's writes wait on flow
        control while its queue in the store fills up and turns into a fresh SNAPSHOT. A
        watcher that takes batches (`max_batch` > 1) gets the changes of up to `coalesce_ms`
        (`--watch-coalesce-ms`) after the first one as one message: one write per interval
        instead of one per change (every change still sent, in order)."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        loop_thread = threading.get_ident()

        def notify() -> None:
            # Called by the store's writers: RPCs on this loop (set directly, no self-pipe
            # write) or another thread (the lease reaper, the etcd store's watch). A closed
            # loop just means shutdown.
            if threading.get_ident() == loop_thread:
                wake.set()
                return
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(wake.set)

        coalesce_s = self._coalesce_s if request.max_batch > 1 else 0.0
        sub = self._store.watch(request.from_revision, notify)
        try:
            while True:
                wake.clear()
                for event in _outgoing(sub.poll(), request):
                    yield event
                await wake.wait()
                if coalesce_s:
                    # A gRPC write costs tens of us of the serving thread however little it
                    # holds: at 1,000 heartbeats/s a watcher woken per change took one write per
                    # heartbeat; now one per interval, with everything that queued meanwhile.
                    await asyncio.sleep(coalesce_s)
        finally:
            sub.close()
