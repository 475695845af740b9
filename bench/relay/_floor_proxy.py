"""The floor of the gateway's libraries: a bare uvicorn + aiohttp prefill -> decode relay.

For the relay benchmark's `python-floor` proxies only (`bench/relay/proxies.py`): what the cheapest
relay on the stack `pdplane gateway` is built on costs per request, next to pdplane's own.
Served as `pdplane gateway` serves (uvicorn, loop "auto" = uvloop, httptools, no access log,
no proxy headers); one aiohttp `ClientSession` with a pooled connector set up like the
gateway's (`pdplane.gateway.upstream`). Per request, on one fixed (prefill, decode) pair:

1. prefill leg: the client's JSON with `max_tokens=1`, `stream=false`, no `stream_options`, and
   the `kv_transfer_params` the gateway sends (`do_remote_decode`, a request id);
2. decode leg: the client's bytes plus prefill's returned `kv_transfer_params`, spliced in;
3. decode's answer (SSE or JSON) relayed to the client unchanged, chunk by chunk as it arrives.

Nothing else: no scheduling, registry, metrics, validation, timeouts on reads, retries,
disconnect handling or error shaping (an upstream failure is uvicorn's 500).

    python -m bench.relay._floor_proxy --prefill URL --decode URL --port N [--app asgi|fastapi]

`--app asgi` is a bare ASGI callable (the gateway's relay endpoints also sit in front of its
FastAPI app as plain ASGI); `--app fastapi` the same relay as a FastAPI route returning
Starlette's `StreamingResponse`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask
from starlette.types import Receive, Scope, Send

from pdplane.core.kv_params import PrefillRequestParams

__all__ = ["FloorAsgi", "Relay", "fastapi_app", "main"]

#: The prefill leg's kv_transfer_params as the gateway sends them, but for the request id.
_PREFILL_KV = PrefillRequestParams("").to_dict()
_ID_PREFIX = f"floor-{uuid.uuid4().hex[:8]}-"
_ids = itertools.count(1)


class Relay:
    """Both legs on the fixed pair (`prefill`, `decode`: base URLs), over one pooled session."""

    def __init__(self, prefill: str, decode: str) -> None:
        self.prefill = prefill.rstrip("/")
        self.decode = decode.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, keepalive_timeout=4.0, ttl_dns_cache=300
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, connect=5.0),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def open(self, path: str, raw: bytes) -> aiohttp.ClientResponse:
        """Runs the prefill leg, then opens the decode leg; the caller reads and releases it."""
        session = self._session
        assert session is not None, "Relay.start() was not awaited"
        request_id = f"{_ID_PREFIX}{next(_ids):x}"
        headers = {"content-type": "application/json", "x-request-id": request_id}
        body = json.loads(raw)
        body.pop("stream_options", None)
        body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        body["stream"] = False
        body["kv_transfer_params"] = {**_PREFILL_KV, "pdplane_request_id": request_id}
        prefill_body = json.dumps(body, separators=(",", ":")).encode()
        async with session.post(self.prefill + path, data=prefill_body, headers=headers) as r:
            kv = json.loads(await r.read())["kv_transfer_params"]
        kv_json = json.dumps(kv, separators=(",", ":")).encode()
        decode_body = raw.rstrip()[:-1] + b',"kv_transfer_params":' + kv_json + b"}"
        return await session.post(self.decode + path, data=decode_body, headers=headers)


class FloorAsgi:
    """The relay as a bare ASGI app (lifespan: the session's start and close)."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await self.relay.start()
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await self.relay.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        raw, more = b"", True
        while more:
            message = await receive()
            raw += message.get("body", b"")
            more = message.get("more_body", False)
        resp = await self.relay.open(scope["path"], raw)
        try:
            content_type = resp.headers.get("content-type", "application/json").encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": resp.status,
                    "headers": [(b"content-type", content_type)],
                }
            )
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            resp.release()


def fastapi_app(relay: Relay) -> FastAPI:
    """The relay as one FastAPI route on both OpenAI endpoints."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await relay.start()
        yield
        await relay.close()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.post("/v1/chat/completions")
    @app.post("/v1/completions")
    async def relay_route(request: Request) -> StreamingResponse:
        resp = await relay.open(request.scope["path"], await request.body())
        return StreamingResponse(
            resp.content.iter_any(),
            resp.status,
            media_type=resp.headers.get("content-type", "application/json"),
            background=BackgroundTask(resp.release),
        )

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="prefill base URL")
    parser.add_argument("--decode", required=True, help="decode base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--app", choices=("asgi", "fastapi"), default="asgi")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    relay = Relay(args.prefill, args.decode)
    app = FloorAsgi(relay) if args.app == "asgi" else fastapi_app(relay)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        loop="auto",
        http="httptools",
        lifespan="on",
        access_log=False,
        proxy_headers=False,
        log_level=args.log_level,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
