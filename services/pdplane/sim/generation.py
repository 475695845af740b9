"""The OpenAI completion routes of a sim: admission, prefill or KV pull, token-by-token output.

Timing: the first token comes `ttft_per_token_ms * prompt_tokens` after admission (or, on a
decode that loads remote KV, `kv_transfer_ms_per_token * tokens` after it), then one token every
`itl_ms`. Times are absolute deadlines from the first token, so slow writes do not add drift.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from aiohttp import web

from pdplane.core.kv_params import KvParamsError
from pdplane.sim.kvflow import KvIntent, classify, producer_params
from pdplane.sim.protocol import SimApiError, SimRequest, parse_request
from pdplane.sim.records import RequestRecord
from pdplane.sim.responses import ResponseWriter
from pdplane.sim.state import SimState
from pdplane.sim.tokens import generate
from pdplane.sim.transfers import HeldTransfer

__all__ = ["CompletionRoutes", "error_response"]

_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


def error_response(error: SimApiError) -> web.Response:
    """vLLM's JSON error body with the error's HTTP status."""
    return web.json_response(error.body(), status=error.status)


async def _sleep_until(loop: asyncio.AbstractEventLoop, deadline: float) -> None:
    delay = deadline - loop.time()
    if delay > 0:
        await asyncio.sleep(delay)


async def _forever() -> None:
    # A stall ends only when the client disconnects (the handler is cancelled) or on shutdown.
    await asyncio.get_running_loop().create_future()


def _drop(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()


class CompletionRoutes:
    """`/v1/completions` and `/v1/chat/completions` over one sim's state."""

    def __init__(self, state: SimState) -> None:
        self._s = state

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions (stream or not)."""
        return await self._serve(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions (stream or not)."""
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response(SimApiError(400, "request body is not valid JSON"))
        record = self._s.recorder.add(request.path, request.headers.get("X-Request-Id", ""), body)
        try:
            response = await self._run(request, body, chat, record)
            record.status = None if record.fault == "drop" else response.status
            return response
        except asyncio.CancelledError:
            record.cancelled = True
            raise
        finally:
            record.finished = True

    async def _run(
        self, request: web.Request, body: Any, chat: bool, record: RequestRecord
    ) -> web.StreamResponse:
        s, c = self._s, self._s.config
        try:
            req = parse_request(
                body,
                chat=chat,
                model=c.model,
                max_model_len=c.max_model_len,
                default_seed=c.seed,
            )
            intent = classify(req.kv_transfer_params, record.request_id)
        except SimApiError as exc:
            return error_response(exc)
        except KvParamsError as exc:
            return error_response(SimApiError(400, str(exc), param="kv_transfer_params"))
        record.fault = s.faults.draw()
        if record.fault == "http500":
            return error_response(
                SimApiError(500, "simulated engine failure", "InternalServerError")
            )
        producer = intent is not None and intent.role == "producer"
        need = req.prompt_tokens + (1 if producer else req.max_tokens)
        admission = await s.engine.admit(s.engine.blocks_for(need))
        held: HeldTransfer | None = None
        try:
            loop = asyncio.get_running_loop()
            started = loop.time()
            await self._prefill_or_pull(req, intent, record)
            result = str(record.kv.get("result", "")) if record.kv else ""
            if result.startswith("failed") and c.kv_load_failure_policy == "fail":
                return error_response(
                    SimApiError(500, f"KV load failed: {result}", "InternalServerError")
                )
            first_at = loop.time()
            s.metrics.ttft.observe(first_at - started)
            s.metrics.prompt_tokens.inc(req.prompt_tokens)
            tokens = generate(req.key, req.seed, req.max_tokens)
            writer = ResponseWriter(chat=chat, model=c.model, prompt_tokens=req.prompt_tokens)
            kv_out = None
            if producer:
                assert intent is not None
                held = HeldTransfer(
                    uuid.uuid4().hex,
                    intent.request_id,
                    admission.block_ids[: s.engine.blocks_for(req.prompt_tokens)],
                    req.prompt_tokens,
                )
                kv_out = producer_params(
                    request_id=held.request_id,
                    transfer_id=held.transfer_id,
                    engine_id=s.instance_id,
                    kv_endpoint=s.kv_endpoint,
                    block_ids=held.block_ids,
                    num_tokens=held.num_tokens,
                    kv_layout=s.layout_fingerprint,
                )
                record.kv = {
                    "role": "producer",
                    "transfer_id": held.transfer_id,
                    "blocks": len(held.block_ids),
                }
            if req.stream:
                response = await self._stream(request, req, writer, tokens, record, first_at)
            else:
                response = await self._whole(request, req, writer, tokens, record, first_at, kv_out)
            s.metrics.e2e.observe(loop.time() - started)
            return response
        except BaseException:
            held = None  # nothing was delivered: the blocks go back with the request
            raise
        finally:
            kept = s.engine.finish(admission, keep=len(held.block_ids) if held else 0)
            if held is not None:
                held.block_ids = kept
                s.transfers.hold(held)

    async def _prefill_or_pull(
        self, req: SimRequest, intent: KvIntent | None, record: RequestRecord
    ) -> None:
        s, c = self._s, self._s.config
        if intent is None or intent.role == "producer":
            if c.ttft_per_token_ms:
                await asyncio.sleep(c.ttft_per_token_ms * req.prompt_tokens / 1000)
            return
        tokens = min(intent.num_tokens or req.prompt_tokens, req.prompt_tokens)
        decode = intent.decode
        record.kv = {
            "role": "consumer",
            "transfer_id": decode.transfer_id if decode else None,
            "result": "nixl",
        }
        s.metrics.external_queries.inc(req.prompt_tokens)
        s.engine.pulling += 1
        try:
            failure = None
            if decode is not None and decode.kv_layout != s.layout_fingerprint:
                failure = f"layout {decode.kv_layout} != {s.layout_fingerprint}"
            elif c.kv_transfer_ms_per_token:
                await asyncio.sleep(c.kv_transfer_ms_per_token * tokens / 1000)
            if decode is not None:
                answer = await s.peers.complete(
                    decode.kv_endpoint, decode.transfer_id, success=failure is None
                )
                failure = failure or answer
                record.kv["result"] = f"failed: {failure}" if failure else "pulled"
        finally:
            s.engine.pulling -= 1
        if failure is None:
            s.metrics.external_hits.inc(tokens)
        elif c.kv_load_failure_policy == "recompute" and c.ttft_per_token_ms:
            await asyncio.sleep(c.ttft_per_token_ms * req.prompt_tokens / 1000)

    async def _whole(
        self,
        request: web.Request,
        req: SimRequest,
        writer: ResponseWriter,
        tokens: list[str],
        record: RequestRecord,
        first_at: float,
        kv_out: dict[str, Any] | None,
    ) -> web.StreamResponse:
        s, c = self._s, self._s.config
        if record.fault == "stall":
            await _forever()
        if record.fault == "drop":
            _drop(request)
            return web.Response(status=500)
        if c.itl_ms and len(tokens) > 1:
            loop = asyncio.get_running_loop()
            await _sleep_until(loop, first_at + c.itl_ms * (len(tokens) - 1) / 1000)
        text = "".join(tokens)
        if req.echo_prompt is not None:
            text = req.echo_prompt + text
        record.tokens_sent = len(tokens)
        s.metrics.generation_tokens.inc(len(tokens))
        s.metrics.success("length")
        return web.json_response(writer.full(text, len(tokens), kv_out))

    async def _stream(
        self,
        request: web.Request,
        req: SimRequest,
        writer: ResponseWriter,
        tokens: list[str],
        record: RequestRecord,
        first_at: float,
    ) -> web.StreamResponse:
        s, c = self._s, self._s.config
        loop = asyncio.get_running_loop()
        response = web.StreamResponse(headers=_SSE_HEADERS)
        await response.prepare(request)
        strike = min(s.faults.fail_after_tokens, len(tokens)) if record.fault else -1
        itl_s = c.itl_ms / 1000
        try:
            head = writer.role_chunk()
            if head is not None:
                await response.write(head)
            if req.echo_prompt is not None:
                await response.write(writer.token_chunk(req.echo_prompt, False))
            last = len(tokens) - 1
            previous = first_at
            for i, token in enumerate(tokens):
                if i == strike:
                    return await self._strike(request, response, record)
                if itl_s and i:
                    await _sleep_until(loop, first_at + i * itl_s)
                    now = loop.time()
                    s.metrics.itl.observe(now - previous)
                    previous = now
                await response.write(writer.token_chunk(token, i == last))
                record.tokens_sent += 1
            if strike == len(tokens):
                return await self._strike(request, response, record)
            if req.include_usage:
                await response.write(writer.usage_chunk(len(tokens)))
            await response.write(writer.done())
            await response.write_eof()
        except ConnectionResetError:
            record.cancelled = True
            return response
        s.metrics.generation_tokens.inc(len(tokens))
        s.metrics.success("length")
        return response

    @staticmethod
    async def _strike(
        request: web.Request, response: web.StreamResponse, record: RequestRecord
    ) -> web.StreamResponse:
        if record.fault == "stall":
            await _forever()
        _drop(request)
        return response
