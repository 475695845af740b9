"""gRPC plumbing shared by every pdplane server and client: health, reflection, token auth, TLS.

Every pdplane gRPC server exposes `grpc.health.v1.Health` (its answers carry the process's
`pdplane.core.server_id` as initial metadata) and server reflection, v1 and v1alpha (so
`grpcurl`, `pdplane grpc` and `grpc_health_probe` work) and, when a token is configured, rejects
calls without the gRPC metadata `authorization: Bearer <token>` with UNAUTHENTICATED (who may
do what: `pdplane.core.grpc.auth`). Both the
sync (`grpc.server`, used inside vLLM's engine process) and the asyncio (`grpc.aio.server`)
flavours are covered.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdplane.core.grpc.auth import AUTH_KEY, AuthPolicy, ConflictingCredentials
from pdplane.core.grpc.message_check import AioDecodeErrorInterceptor, DecodeErrorInterceptor
from pdplane.core.grpc.reflection import enable_reflection
from pdplane.core.server_id import METADATA_KEY, server_id

__all__ = [
    "CHANNEL_OPTIONS",
    "CONTROL_MAX_RECEIVE_BYTES",
    "FAST_RECONNECT_OPTIONS",
    "KV_SERVER_OPTIONS",
    "SERVER_OPTIONS",
    "AioTokenAuthInterceptor",
    "TokenAuthInterceptor",
    "add_health_and_reflection",
    "add_port",
    "aio_add_health_and_reflection",
    "aio_channel",
    "aio_server_interceptors",
    "aio_stop",
    "channel",
    "refusal",
    "server_interceptors",
    "token_metadata",
]

#: Channel options shared by every pdplane client: fail fast on a dead peer instead of
#: buffering forever, and allow KV chunks and large registry snapshots of up to 64 MiB (bytes).
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]
_SERVER_BASE_OPTIONS: list[tuple[str, Any]] = [
    # Accept the clients' 10 s keepalive pings, also on idle watch streams; gRPC's default
    # (one ping per 5 min) answers them with GOAWAY "too_many_pings" and breaks the watch.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    # Answers (registry snapshots, in-flight exchange snapshots, KV chunks) may be large.
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
]
#: Largest request message (bytes) a control-plane server (registry, scheduler, in-flight
#: exchange) accepts; a larger one is RESOURCE_EXHAUSTED (gRPC's own check) before it is
#: decoded. gRPC's default 4 MiB. The largest legitimate requests: a ScheduleRequest for a
#: 1,048,576-token prompt carries prefix hashes at block sizes 16, 32 and 64 (65,536 + 32,768 +
#: 16,384 uint64 varints of at most 10 bytes: 1.1 MiB) plus `prefix_block_hashes` at block size
#: 16 (0.63 MiB), 1.8 MiB in all (block size 8 alone: 1.25 MiB per entry); a RegisterRequest is
#: bounded by the 8 KiB spec cap; a SubscribeInflightRequest is one replica id (the exchange's
#: batches are answers, bounded by the send limit above).
CONTROL_MAX_RECEIVE_BYTES = 4 * 1024 * 1024
#: Options of the control-plane servers (registry, scheduler, in-flight exchange).
SERVER_OPTIONS: list[tuple[str, Any]] = [
    *_SERVER_BASE_OPTIONS,
    ("grpc.max_receive_message_length", CONTROL_MAX_RECEIVE_BYTES),
]
#: Options of the KV data path servers (the connector's KvTransfer server, the sim instance's):
#: a pushed KV chunk (TCP PushBlocks) may be up to 64 MiB (bytes).
KV_SERVER_OPTIONS: list[tuple[str, Any]] = [
    *_SERVER_BASE_OPTIONS,
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `token` as a bearer token; empty when no token is configured."""
    return ((AUTH_KEY, f"Bearer {token}"),) if token else ()


def _is_open(method: str) -> bool:
    # Health and reflection stay open so that probes work without the token.
    return method.startswith(("/grpc.health.v1.", "/grpc.reflection."))


DENIED = "missing or invalid bearer token"


def refusal(
    policy: AuthPolicy, method: str, metadata: Iterable[tuple[str, str | bytes]] | None
) -> str | None:
    """Why a call of `method` with `metadata` is refused (its UNAUTHENTICATED details), or
    None to let it through: health and reflection are open; conflicting credentials and a
    missing or wrong one are refused."""
    if _is_open(method):
        return None
    try:
        role = policy.role(metadata)
    except ConflictingCredentials as exc:
        return str(exc)
    return None if role is not None else DENIED


# The refusals are request-streaming whatever the method's shape: gRPC then reads a request
# message only when the handler iterates its requests, which a refusal never does, so an
# unauthenticated unary call is refused after its headers instead of after its whole (up to
# the receive limit) message was buffered and decoded. On the wire a unary client cannot tell
# the difference: it sees UNAUTHENTICATED. Response-streaming methods keep a streaming refusal
# because gRPC drives those handlers as iterators.


def _deny_handler(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    def deny(_requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    return grpc.stream_unary_rpc_method_handler(deny)


def _aio_deny_handler(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    # On an asyncio server the refusal must be a coroutine / async generator: a plain function
    # there runs on the event loop's thread and, for streaming shapes, blocked that loop for
    # good (every later RPC timed out and the server could no longer be stopped).
    async def deny(_requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    async def deny_stream(
        _requests: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        yield  # pragma: no cover - abort raises; this only makes it an async generator

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream)
    return grpc.stream_unary_rpc_method_handler(deny)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Sync server interceptor: UNAUTHENTICATED unless the call satisfies `policy`
    (`pdplane.core.grpc.auth`: a configured credential, never two conflicting ones)."""

    def __init__(self, policy: AuthPolicy | str) -> None:
        # A bare string is the shared token alone.
        self._policy = AuthPolicy(token=policy) if isinstance(policy, str) else policy

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        why = (
            None
            if handler is None
            else refusal(
                self._policy, handler_call_details.method, handler_call_details.invocation_metadata
            )
        )
        if handler is None or why is None:
            return handler
        return _deny_handler(handler, why)


class AioTokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """The asyncio twin of `TokenAuthInterceptor`."""

    def __init__(self, policy: AuthPolicy | str) -> None:
        # A bare string is the shared token alone.
        self._policy = AuthPolicy(token=policy) if isinstance(policy, str) else policy

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        why = (
            None
            if handler is None
            else refusal(
                self._policy, handler_call_details.method, handler_call_details.invocation_metadata
            )
        )
        if handler is None or why is None:
            return handler
        return _aio_deny_handler(handler, why)


def server_interceptors(
    token: str | None, admin_token: str | None = None
) -> list[grpc.ServerInterceptor]:
    """The interceptors of every sync pdplane server: credentials (`grpc_auth.AuthPolicy` of
    `token` and `admin_token`; conflicting `authorization` values are refused even when none is
    configured), then INVALID_ARGUMENT for requests that do not decode (`grpc_decode`)."""
    return [TokenAuthInterceptor(AuthPolicy(token, admin_token)), DecodeErrorInterceptor()]


def aio_server_interceptors(
    token: str | None, admin_token: str | None = None
) -> list[grpc.aio.ServerInterceptor]:
    """The asyncio twin of `server_interceptors`."""
    return [AioTokenAuthInterceptor(AuthPolicy(token, admin_token)), AioDecodeErrorInterceptor()]


def _reflect(server: grpc.Server | grpc.aio.Server, names: list[str]) -> None:
    enable_reflection(server, [*names, health.SERVICE_NAME])


class _IdentifiedHealth(health.HealthServicer):
    """grpc.health.v1.Health whose Check answers carry this process's server id."""

    def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        context.send_initial_metadata(((METADATA_KEY, server_id()),))
        return super().Check(request, context)


class _AioIdentifiedHealth(health.aio.HealthServicer):
    """The asyncio twin of `_IdentifiedHealth`."""

    async def Check(  # type: ignore[override]
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        await context.send_initial_metadata(((METADATA_KEY, server_id()),))
        return await super().Check(request, context)


def add_health_and_reflection(
    server: grpc.Server, service_names: Iterable[str]
) -> health.HealthServicer:
    """Registers grpc.health.v1.Health (every name SERVING) and reflection on a sync server.

    `service_names` are full names such as "pdplane.v1.Registry". Returns the health servicer
    so the caller can flip statuses (e.g. NOT_SERVING while draining).
    """
    names = list(service_names)
    servicer = _IdentifiedHealth(experimental_non_blocking=True)
    for name in [*names, ""]:
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    _reflect(server, names)
    return servicer


#: Names of the coroutines of gRPC's own per-call tasks (grpc.aio's server): `aio_stop` waits
#: for these.
_GRPC_CALL_TASKS = frozenset({"_schedule_rpc_coro", "_handle_exceptions"})


async def aio_stop(server: grpc.aio.Server, grace: float | None, settle_s: float = 1.0) -> None:
    """`server.stop(grace)` (s; None: cancel at once), then waits up to `settle_s` (s) for
    gRPC's per-call tasks to end. gRPC cancels the calls still open at the end of the grace
    (watch and heartbeat streams) and each call's task settles a few loop turns after `stop`
    returned; a loop closed before that (`asyncio.run` cancels what is left) cancels gRPC's
    own task, which logs an ERROR with a CancelledError traceback per open stream."""
    await server.stop(grace)
    calls = [
        t
        for t in asyncio.all_tasks()
        if getattr(t.get_coro(), "__name__", None) in _GRPC_CALL_TASKS
    ]
    if calls:
        await asyncio.wait(calls, timeout=settle_s)


async def aio_add_health_and_reflection(
    server: grpc.aio.Server, service_names: Iterable[str]
) -> health.aio.HealthServicer:
    """The asyncio-server twin of `add_health_and_reflection` (same contract)."""
    names = list(service_names)
    servicer = _AioIdentifiedHealth()
    for name in [*names, ""]:
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    _reflect(server, names)
    return servicer


def add_port(
    server: grpc.Server | grpc.aio.Server,
    address: str,
    tls_cert: str | Path | None = None,
    tls_key: str | Path | None = None,
) -> int:
    """Binds `address` ("host:port", port 0 = any free port), with TLS when cert and key are set.

    Returns the bound port. Raises ValueError when only one of cert/key is given and RuntimeError
    when the address cannot be bound.
    """
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("TLS needs both a certificate and a key")
    if tls_cert and tls_key:
        creds = grpc.ssl_server_credentials(
            [(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())]
        )
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"cannot bind gRPC server to {address}")
    return port


def _credentials(tls_ca: str | Path | None) -> grpc.ChannelCredentials | None:
    if tls_ca is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())


#: Extra options for clients that must notice a restarted server within about a second (the
#: registry client): gRPC's default reconnect backoff grows to 120 s; this one stops at 0.5 s.
FAST_RECONNECT_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


def channel(
    target: str,
    tls_ca: str | Path | None = None,
    extra_options: Iterable[tuple[str, Any]] = (),
) -> grpc.Channel:
    """A sync channel to `target` ("host:port"); TLS when `tls_ca` (a PEM file) is given.

    `extra_options` are appended to `CHANNEL_OPTIONS` (e.g. `FAST_RECONNECT_OPTIONS`).
    """
    creds = _credentials(tls_ca)
    options = [*CHANNEL_OPTIONS, *extra_options]
    if creds is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, creds, options=options)


def aio_channel(
    target: str,
    tls_ca: str | Path | None = None,
    extra_options: Iterable[tuple[str, Any]] = (),
) -> grpc.aio.Channel:
    """An asyncio channel to `target` ("host:port"); TLS when `tls_ca` (a PEM file) is given."""
    creds = _credentials(tls_ca)
    options = [*CHANNEL_OPTIONS, *extra_options]
    if creds is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, creds, options=options)
