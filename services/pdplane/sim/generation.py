"""The OpenAI completion routes of a sim: parse, hand the request to the engine, write tokens.

Timing comes from the engine model (`pdplane.sim.engine`, stepped by `pdplane.sim.runner`):
the handler waits for the engine's progress notifications (first token, every
`stream_interval` tokens, the end) and writes what was generated since the last one, one SSE
event per token. A prefill for a remote decode (`do_remote_decode`) keeps its blocks under a
new transfer id (and in push mode pushes them to the named decode); a decode with
`do_remote_prefill` loads them (`pdplane.sim.kvload`).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from itertools import accumulate
from typing import Any

from aiohttp import web

from pdplane.core.kv_params import KvParamsError
from pdplane.sim.engine import EngineRequest, Phase
from pdplane.sim.kvflow import KvIntent, classify, producer_params
from pdplane.sim.kvload import KvLoader, LoadContext
from pdplane.sim.protocol import SimApiError, SimRequest, parse_request
from pdplane.sim.records import RequestRecord
from pdplane.sim.responses import ResponseWriter
from pdplane.sim.state import SimState
from pdplane.sim.tokens import continuation, resumed
from pdplane.sim.transfers import HeldTransfer

__all__ = ["CompletionRoutes", "error_response"]

_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


def error_response(error: SimApiError) -> web.Response:
    """vLLM's JSON error body with the error's HTTP status."""
    return web.json_response(error.body(), status=error.status)


async def _stream_error(stream: web.StreamResponse, error: SimApiError) -> web.StreamResponse:
    """Ends a started stream as vLLM does when its request fails: one `data: {"error": ...}`
    event, then `data: [DONE]`."""
    body = json.dumps(error.body(), separators=(",", ":")).encode()
    await stream.write(b"data: " + body + b"\n\ndata: [DONE]\n\n")
    await stream.write_eof()
    return stream


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
        self._loader = KvLoader(state)
        state.runner.loader = self._loader

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions (stream or not)."""
        return await self._serve(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions (stream or not)."""
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            # RecursionError: nesting deeper than json's recursion limit ("[" * 100_000)
            return error_response(SimApiError(400, "request body is not valid JSON"))
        record = self._s.recorder.add(request.path, request.headers.get("X-Request-Id", ""), body)
        try:
            response = await self._run(request, body, chat, record)
            record.status = None if record.fault == "drop" else response.status
            return response
        except asyncio.CancelledError:
            record.cancelled = True
            raise
        except ConnectionResetError:
            # The client left before anything was written, and this handler resumed before
            # aiohttp's cancel reached it: its first write (the stream's headers) found the
            # closed transport. vLLM aborts such a request; the response below is never sent
            # (aiohttp drops it).
            record.cancelled = True
            return web.StreamResponse()
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
                tokenizer=s.tokenizer,
            )
            intent = classify(req.kv_transfer_params, record.request_id)
        except SimApiError as exc:
            return error_response(exc)
        except KvParamsError as exc:
            return error_response(SimApiError(400, str(exc), param="kv_transfer_params"))
        record.fault = s.faults.draw(record.request_id)
        if record.fault == "http500":
            return error_response(
                SimApiError(500, "simulated engine failure", "InternalServerError")
            )
        producer = intent is not None and intent.role == "producer"
        consumer = intent is not None and intent.role == "consumer"
        assert s.tokenizer is not None
        answer = None
        if consumer and intent is not None and intent.decode is not None:
            # Prefill's prompt + its first token (the gateway streamed that one already).
            answer = continuation(
                s.tokenizer, req.prompt_ids, intent.num_tokens, req.seed, req.max_tokens
            )
        elif intent is None and c.role == "decode" and not chat:
            # The same prompt computed here, without KV (a decode taking over from one that
            # could not be reached): a model continues its own first token the same way.
            answer = continuation(
                s.tokenizer, req.prompt_ids, len(req.prompt_ids) - 1, req.seed, req.max_tokens
            )
        if answer is None and req.prompt_as_ids and req.return_token_ids:
            # A prompt that ends in part of its own answer (a stream resumed elsewhere: the
            # gateway asks for token ids on those legs). Other prompts are not searched: a
            # prompt whose last id merely equals its own first sampled token (1 in
            # len(VOCAB)) keeps its own answer.
            answer = resumed(
                s.tokenizer, req.prompt_ids, req.seed, 1 if producer else req.max_tokens
            )
        ids, pieces = answer or s.tokenizer.sample(
            req.key, req.seed, 1 if producer else req.max_tokens
        )
        tokens = pieces  # each token's own text (logprobs name them)
        stopped = req.stop.apply(pieces) if req.stop is not None else None
        if stopped is not None:  # the engine stops at the token that completes a stop string
            ids, pieces = ids[: len(stopped.deltas)], stopped.deltas
        ereq = EngineRequest(
            record.request_id or uuid.uuid4().hex,
            req.prompt_ids,
            ids,
            remote_tokens=(intent.num_tokens or req.prompt_tokens) if intent and consumer else 0,
            hold=producer,
        )
        if consumer:
            assert intent is not None
            self._loader.contexts[ereq] = LoadContext(intent, record)
        loop = asyncio.get_running_loop()
        started = loop.time()
        held: HeldTransfer | None = None
        try:
            now = s.runner.now()
            await s.runner.sleep(s.frontend.admit(now) - now)  # the API server's FIFO + hop
            s.runner.submit(ereq)
            record.queued_step = ereq.queued_step
            stream: web.StreamResponse | None = None
            if req.stream:
                # vLLM (uvicorn) sends a stream's headers once the request is in the engine,
                # before its first token (on decode: before the KV load).
                stream = web.StreamResponse(headers=_SSE_HEADERS)
                headers = await stream.prepare(request)
                if headers is not None:
                    headers.send_headers()  # aiohttp would hold them until the first write
            while ereq.num_output == 0 and ereq.phase != Phase.DONE:
                await s.runner.progress(ereq)
            if ereq.first_token_step > 0:
                record.first_token_step = ereq.first_token_step
            if ereq.num_output == 0:  # the engine gave up on it: a failed KV load
                result = str(record.kv.get("result", "")) if record.kv else "failed"
                failure = SimApiError(500, f"KV load failed: {result}", "InternalServerError")
                if stream is None:
                    return error_response(failure)
                return await _stream_error(stream, failure)
            writer = ResponseWriter(
                chat=chat,
                model=c.model,
                prompt_tokens=req.prompt_tokens,
                prompt_ids=list(req.prompt_ids) if req.return_token_ids else None,
            )
            if stopped is not None:
                writer.stopped_by(stopped.stop)
            kv_out = None
            if producer:
                assert intent is not None
                held, kv_out = await self._hold(ereq, req, intent, record)
            if stream is not None:
                response = await self._stream(
                    request, stream, req, writer, ereq, ids, pieces, record, tokens
                )
            else:
                response = await self._whole(
                    request, req, writer, ereq, ids, pieces, record, kv_out, tokens
                )
            s.metrics.e2e.add((loop.time() - started) * c.time_scale)
            return response
        except BaseException:
            if held is not None:  # nothing was delivered: the blocks go back
                s.transfers.release(held.transfer_id, "failed")
            raise
        finally:
            self._loader.contexts.pop(ereq, None)
            if ereq.phase != Phase.DONE:
                s.runner.abort(ereq)
            elif ereq.hold and held is None and ereq.blocks:
                s.runner.release(ereq.blocks)
                ereq.blocks = []

    async def _hold(
        self, ereq: EngineRequest, req: SimRequest, intent: KvIntent, record: RequestRecord
    ) -> tuple[HeldTransfer, dict[str, Any]]:
        """Keeps a finished prefill's blocks for its decode (pushing them in push mode)."""
        s = self._s
        while ereq.phase != Phase.DONE:  # max_tokens=1: done with the first token
            await s.runner.progress(ereq)
        held = HeldTransfer(uuid.uuid4().hex, intent.request_id, ereq.blocks, req.prompt_tokens)
        ereq.blocks = []
        s.transfers.hold(held)
        pushed = False
        if s.config.kv_mode == "push" and intent.push_to:
            pushed = await s.pusher.push(
                intent.push_to,
                held.transfer_id,
                s.instance_id,
                s.kv_layout,
                len(held.block_ids),
                s.peers.metadata,
            )
            if pushed:
                s.core.stats.kv_bytes_out += len(held.block_ids) * s.block_bytes
        record.kv = {
            "role": "producer",
            "transfer_id": held.transfer_id,
            "blocks": len(held.block_ids),
        }
        if pushed:
            record.kv["pushed"] = True
        kv_out = producer_params(
            request_id=held.request_id,
            transfer_id=held.transfer_id,
            engine_id=s.instance_id,
            kv_endpoint=s.kv_endpoint,
            block_ids=held.block_ids,
            num_tokens=held.num_tokens,
            kv_layout=s.layout_fingerprint,
            pushed=s.config.kv_mode == "push" and bool(intent.push_to),
        )
        # vLLM (0.32) adds prefill's prefix cache hit to the params its connector returns.
        kv_out["remote_prefill_cached_tokens"] = ereq.local_hit
        return held, kv_out

    async def _whole(
        self,
        request: web.Request,
        req: SimRequest,
        writer: ResponseWriter,
        ereq: EngineRequest,
        ids: list[int],
        pieces: list[str],
        record: RequestRecord,
        kv_out: dict[str, Any] | None,
        tokens: list[str],
    ) -> web.StreamResponse:
        s = self._s
        if record.fault == "stall":
            await _forever()
        if record.fault == "drop":
            _drop(request)
            return web.Response(status=500)
        while ereq.phase != Phase.DONE:
            await s.runner.progress(ereq)
        n = ereq.num_output
        text = "".join(pieces[:n])
        if req.echo_prompt is not None:
            text = req.echo_prompt + text
        record.tokens_sent = n
        logprobs = None
        if req.logprobs is not None:
            assert s.tokenizer is not None
            logprobs = req.logprobs.of(s.tokenizer, ids[:n], tokens[:n], 0)
        return web.json_response(writer.full(text, n, kv_out, ids[:n], logprobs))

    async def _stream(
        self,
        request: web.Request,
        response: web.StreamResponse,
        req: SimRequest,
        writer: ResponseWriter,
        ereq: EngineRequest,
        ids: list[int],
        pieces: list[str],
        record: RequestRecord,
        tokens: list[str],
    ) -> web.StreamResponse:
        """Streams the tokens on `response` (prepared, its headers sent): `pieces` are the
        text each token's chunk carries, `tokens` each token's own (logprobs name them)."""
        s = self._s
        total = len(pieces)
        # completions' text_offset: vLLM advances it by the tokens' own text, not by the
        # text streamed (which lags the tokens while stop strings hold some back)
        offsets = list(accumulate(map(len, tokens), initial=0))

        def logprobs(i: int) -> dict[str, Any] | None:
            if req.logprobs is None or s.tokenizer is None:
                return None
            return req.logprobs.of(s.tokenizer, [ids[i]], [tokens[i]], offsets[i])

        strike = min(s.faults.fail_after_tokens, total) if record.fault else -1
        try:
            head = writer.role_chunk()
            if req.echo_prompt is not None:
                echo = writer.token_chunk(req.echo_prompt, False)
                head = echo if head is None else head + echo
            if head is not None:
                await response.write(head)
            sent = 0
            while True:
                ready = ereq.num_output
                if strike >= 0 and ready >= strike > sent:
                    ready = strike
                if ready > sent:
                    out = b"".join(
                        writer.token_chunk(pieces[i], i == total - 1, ids[i], logprobs(i))
                        for i in range(sent, ready)
                    )
                    await response.write(out)
                    record.tokens_sent = sent = ready
                    kill_at = s.faults.kill_after_tokens
                    if kill_at and sent >= kill_at and s.kill is not None:
                        s.kill()  # the instance dies: this connection is cut with the rest
                        await _forever()
                if sent == strike:
                    return await self._strike(request, response, record)
                if sent >= total or ereq.phase == Phase.DONE:
                    break
                await s.runner.progress(ereq)
            if req.include_usage:
                await response.write(writer.usage_chunk(sent))
            await response.write(writer.done())
            await response.write_eof()
        except ConnectionResetError:
            record.cancelled = True
            return response
        return response

    @staticmethod
    async def _strike(
        request: web.Request, response: web.StreamResponse, record: RequestRecord
    ) -> web.StreamResponse:
        if record.fault == "stall":
            await _forever()
        _drop(request)
        return response
