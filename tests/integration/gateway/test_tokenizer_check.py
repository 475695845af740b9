"""The gateway routes by a fetched tokenizer only once an instance's own `/tokenize` agrees.

A real KV gRPC server publishes the tiny model's tokenizer; a real HTTP server plays the
instance's `/tokenize`, once as vLLM with that tokenizer would answer, once as a server whose
chat template is another (what a processor's or a fallback template would give).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp import web

from pdplane.core.tokenizer.bundle import collect
from pdplane.core.tokenizer.servicer import add_tokenizer_servicer
from pdplane.gateway.fleet_tokenizers import FleetTokenizers, RoutingState
from pdplane.gateway.fleet_view import build_view
from pdplane.gateway.metrics import GatewayMetrics
from pdplane.gateway.prompt_ids import PromptTokenizer, TokenizerSet
from pdplane.gateway.upstream import UpstreamClient
from pdplane.v1 import instance_pb2

MODEL = "tiny"


@pytest.fixture
async def kv_server(tiny_model: Path) -> AsyncIterator[str]:
    server = grpc.aio.server()
    add_tokenizer_servicer(server, collect(tiny_model))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


async def _tokenize_server(answer: Callable[[dict[str, Any]], list[int]]) -> web.AppRunner:
    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"tokens": answer(body), "count": 0})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def _view(kv_endpoint: str, url: str, content_hash: str) -> Any:
    spec = instance_pb2.InstanceSpec(
        instance_id="prefill-0",
        role=instance_pb2.ROLE_BOTH,
        model=MODEL,
        url=url,
        kv_endpoint=kv_endpoint,
        transport=instance_pb2.TRANSPORT_TCP,
        tokenizer_hash=content_hash,
        kv_layout=instance_pb2.KvLayout(block_size=16),
    )
    inst = instance_pb2.Instance(spec=spec, state=instance_pb2.INSTANCE_STATE_SERVING)
    return build_view([inst])


async def _settled(tokenizers: FleetTokenizers) -> RoutingState:
    for _ in range(600):
        state = tokenizers.states().get(MODEL)
        if state is not None and not state.reason.startswith("fetching"):
            return state
        await asyncio.sleep(0.05)
    raise AssertionError(f"no routing state: {tokenizers.states()}")


async def _retried(tokenizers: FleetTokenizers) -> None:
    for _ in range(600):
        state = tokenizers.states().get(MODEL)
        if state is not None and "retrying in 2 s" in state.reason:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no retry: {tokenizers.states()}")


@pytest.mark.parametrize("agrees", [True, False])
async def test_a_tokenizer_is_used_only_when_the_instances_tokenize_agrees(
    tiny_model: Path,
    tmp_path: Path,
    kv_server: str,
    agrees: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    tok = PromptTokenizer(tiny_model)

    def answer(body: dict[str, Any]) -> list[int]:
        if "messages" in body:
            ids = tok.chat_ids(body, 0) or []
            return ids if agrees else [*ids[:-1], ids[-1] + 1]  # another chat template
        return tok.completion_ids(body, 0) or []

    runner = await _tokenize_server(answer)
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    upstream = UpstreamClient()
    metrics = GatewayMetrics()
    tokenizers = FleetTokenizers(
        TokenizerSet({}), cache_dir=tmp_path, upstream=upstream, metrics=metrics
    )
    try:
        with caplog.at_level(logging.INFO, "pdplane.gateway.fleet_tokenizers"):
            tokenizers.observe(_view(kv_server, url, collect(tiny_model).content_hash))
            state = await _settled(tokenizers)
            if not agrees:  # the same failure again after its retry: no second log line
                await _retried(tokenizers)
    finally:
        await tokenizers.close()
        await upstream.close()
        await runner.cleanup()
    if agrees:
        assert state.precise and tokenizers.get(MODEL) is not None, state
    else:
        assert not state.precise and tokenizers.get(MODEL) is None
        assert "/tokenize disagrees with it: the ids of a chat" in state.reason, state
        assert "retrying in 1 s" in state.reason
        lines = [r for r in caplog.records if "routing by load only" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]
    gauge = metrics.routing_precise.labels(MODEL)._value.get()
    assert gauge == (1.0 if agrees else 0.0)
