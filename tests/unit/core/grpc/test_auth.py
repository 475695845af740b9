"""Token auth of pdplane gRPC servers: every RPC shape, both server flavours.

A call without the token must be refused with UNAUTHENTICATED and leave the server fully
responsive (a deny handler that blocks the asyncio server's event loop froze the registry).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from pdplane.core.grpc import util as grpc_util
from pdplane.core.grpc.auth import AuthPolicy, CallerRole

_SERVICE = "test.Echo"
_TOKEN = "s3cret"
_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


def _identity(data: bytes) -> bytes:
    return data


def _sync_handlers() -> grpc.GenericRpcHandler:
    def unary_unary(request: bytes, _ctx: Any) -> bytes:
        return request

    def unary_stream(request: bytes, _ctx: Any) -> Iterator[bytes]:
        yield request

    def stream_unary(requests: Iterator[bytes], _ctx: Any) -> bytes:
        return b"".join(requests)

    def stream_stream(requests: Iterator[bytes], _ctx: Any) -> Iterator[bytes]:
        yield from requests

    return _generic(unary_unary, unary_stream, stream_unary, stream_stream)


def _aio_handlers() -> grpc.GenericRpcHandler:
    async def unary_unary(request: bytes, _ctx: Any) -> bytes:
        return request

    async def unary_stream(request: bytes, _ctx: Any) -> AsyncIterator[bytes]:
        yield request

    async def stream_unary(requests: AsyncIterator[bytes], _ctx: Any) -> bytes:
        return b"".join([r async for r in requests])

    async def stream_stream(requests: AsyncIterator[bytes], _ctx: Any) -> AsyncIterator[bytes]:
        async for r in requests:
            yield r

    return _generic(unary_unary, unary_stream, stream_unary, stream_stream)


def _generic(uu: Any, us: Any, su: Any, ss: Any) -> grpc.GenericRpcHandler:
    opts = {"request_deserializer": _identity, "response_serializer": _identity}
    return grpc.method_handlers_generic_handler(
        _SERVICE,
        {
            "unary_unary": grpc.unary_unary_rpc_method_handler(uu, **opts),
            "unary_stream": grpc.unary_stream_rpc_method_handler(us, **opts),
            "stream_unary": grpc.stream_unary_rpc_method_handler(su, **opts),
            "stream_stream": grpc.stream_stream_rpc_method_handler(ss, **opts),
        },
    )


def _call(chan: grpc.Channel, kind: str, metadata: tuple[tuple[str, str], ...]) -> bytes:
    method = f"/{_SERVICE}/{kind}"
    opts: dict[str, Any] = {"request_serializer": _identity, "response_deserializer": _identity}
    kw: dict[str, Any] = {"timeout": 3, "metadata": metadata}
    if kind == "unary_unary":
        return chan.unary_unary(method, **opts)(b"x", **kw)
    if kind == "unary_stream":
        return b"".join(chan.unary_stream(method, **opts)(b"x", **kw))
    if kind == "stream_unary":
        return chan.stream_unary(method, **opts)(iter([b"x"]), **kw)
    return b"".join(chan.stream_stream(method, **opts)(iter([b"x"]), **kw))


class _AioServer:
    """An asyncio gRPC server with the token interceptor, on its own loop thread."""

    def __init__(self) -> None:
        self.port = 0
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        server = grpc.aio.server(interceptors=[grpc_util.AioTokenAuthInterceptor(_TOKEN)])
        server.add_generic_rpc_handlers((_aio_handlers(),))
        self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await server.stop(0.2)

    def __enter__(self) -> _AioServer:
        self._thread.start()
        assert self._ready.wait(5)
        return self

    def __exit__(self, *_exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5)
        # A loop blocked by a handler would never see the stop request.
        assert not self._thread.is_alive(), "the server's event loop is stuck"


class _SyncServer:
    def __init__(self) -> None:
        self._pool = futures.ThreadPoolExecutor(4)
        self._server = grpc.server(
            self._pool, interceptors=[grpc_util.TokenAuthInterceptor(_TOKEN)]
        )
        self._server.add_generic_rpc_handlers((_sync_handlers(),))
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    def __enter__(self) -> _SyncServer:
        self._server.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._server.stop(0.2).wait()
        self._pool.shutdown(wait=True)


@pytest.mark.parametrize("flavour", ["aio", "sync"])
@pytest.mark.parametrize("kind", _KINDS)
def test_unauthenticated_call_is_refused_and_server_stays_responsive(
    flavour: str, kind: str
) -> None:
    server = _AioServer() if flavour == "aio" else _SyncServer()
    with server, grpc.insecure_channel(f"127.0.0.1:{server.port}") as chan:
        for metadata in ((), grpc_util.token_metadata("wrong")):
            with pytest.raises(grpc.RpcError) as err:
                _call(chan, kind, metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value
            assert "bearer token" in (err.value.details() or "")
        # Every shape still answers with the token afterwards, well within the deadline.
        for other in _KINDS:
            assert _call(chan, other, grpc_util.token_metadata(_TOKEN)) == b"x"


@pytest.mark.parametrize(
    "value", ["Bearer s\u00e9cret", "Bearer \u2603", b"Bearer \xff\xfe".decode("latin-1")]
)
def test_non_ascii_authorization_is_refused_not_an_error(value: str) -> None:
    # hmac.compare_digest raises TypeError on non-ASCII str: the call would end UNKNOWN
    # (an exception in the interceptor) instead of a plain refusal.
    policy = AuthPolicy(token="secret", admin_token="admin")
    assert policy.role([("authorization", value)]) is None
    assert policy.role([("authorization", "Bearer secret")]) is CallerRole.INSTANCE


def test_a_non_ascii_configured_token_still_matches_itself() -> None:
    policy = AuthPolicy(token="s\u00e9cret")
    assert policy.role([("authorization", "Bearer s\u00e9cret")]) is CallerRole.INSTANCE
    assert policy.role([("authorization", "Bearer secret")]) is None
