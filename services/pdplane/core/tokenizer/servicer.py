"""gRPC servicers of `pdplane.v1.TokenizerFiles`, for sync and asyncio servers.

`add_tokenizer_servicer(server, published)` adds the service to any pdplane gRPC server: the
connector's KvTransfer server (sync `grpc.server`, inside vLLM) or the simulator's
(`grpc.aio.server`). Authentication and TLS are the server's own, so the tokenizer is guarded
exactly like the KV cache next to it. A few fetches run at once (a gateway fetches a model's
tokenizer once per content hash); more are refused with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator

import grpc

from pdplane.core.tokenizer.bundle import TokenizerBundle
from pdplane.v1 import tokenizer_pb2, tokenizer_pb2_grpc

__all__ = ["SERVICE_NAME", "Published", "add_tokenizer_servicer"]

SERVICE_NAME = "pdplane.v1.TokenizerFiles"
#: Fetches served at once by one server.
_MAX_FETCHES = 4

#: What an instance publishes: its bundle, or why it publishes none (one line).
Published = TokenizerBundle | str


class _Gate:
    def __init__(self, published: Published) -> None:
        self.published = published
        self._lock = threading.Lock()
        self._open = 0

    def refusal(
        self, request: tokenizer_pb2.FetchTokenizerRequest
    ) -> tuple[grpc.StatusCode, str] | None:
        bundle = self.published
        if isinstance(bundle, str):
            return grpc.StatusCode.NOT_FOUND, f"this instance publishes no tokenizer: {bundle}"
        if request.content_hash and request.content_hash != bundle.content_hash:
            return (
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this instance serves tokenizer {bundle.content_hash}, not the one asked for",
            )
        with self._lock:
            if self._open >= _MAX_FETCHES:
                return grpc.StatusCode.RESOURCE_EXHAUSTED, f"at most {_MAX_FETCHES} fetches at once"
            self._open += 1
        return None

    def done(self) -> None:
        with self._lock:
            self._open -= 1


class TokenizerFilesServicer(tokenizer_pb2_grpc.TokenizerFilesServicer):
    """Sync servicer (a `grpc.server` thread per fetch)."""

    def __init__(self, published: Published) -> None:
        self._gate = _Gate(published)

    def Fetch(
        self, request: tokenizer_pb2.FetchTokenizerRequest, context: grpc.ServicerContext
    ) -> Iterator[tokenizer_pb2.TokenizerChunk]:
        refusal = self._gate.refusal(request)
        if refusal is not None:
            context.abort(*refusal)
        try:
            assert isinstance(self._gate.published, TokenizerBundle)
            for chunk in self._gate.published.chunks():
                if not context.is_active():
                    return
                yield chunk
        except OSError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"tokenizer file unreadable: {exc.strerror}")
        finally:
            self._gate.done()


class AioTokenizerFilesServicer(tokenizer_pb2_grpc.TokenizerFilesServicer):
    """Asyncio servicer (`grpc.aio.server`)."""

    def __init__(self, published: Published) -> None:
        self._gate = _Gate(published)

    async def Fetch(  # type: ignore[override]
        self, request: tokenizer_pb2.FetchTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[tokenizer_pb2.TokenizerChunk]:
        refusal = self._gate.refusal(request)
        if refusal is not None:
            await context.abort(*refusal)
        try:
            assert isinstance(self._gate.published, TokenizerBundle)
            # 1 MiB reads from a local file: short enough to do on the loop.
            for chunk in self._gate.published.chunks():
                yield chunk
        except OSError as exc:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"tokenizer file unreadable: {exc.strerror}"
            )
        finally:
            self._gate.done()


def add_tokenizer_servicer(server: grpc.Server | grpc.aio.Server, published: Published) -> str:
    """Adds `pdplane.v1.TokenizerFiles` serving `published` (a bundle, or the reason there is
    none: every Fetch is then NOT_FOUND with it) to `server` (sync or asyncio, before it
    starts). Returns the service's full name (for health and reflection lists)."""
    servicer: tokenizer_pb2_grpc.TokenizerFilesServicer
    if isinstance(server, grpc.aio.Server):
        servicer = AioTokenizerFilesServicer(published)
    else:
        servicer = TokenizerFilesServicer(published)
    tokenizer_pb2_grpc.add_TokenizerFilesServicer_to_server(servicer, server)
    return SERVICE_NAME
