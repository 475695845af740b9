"""The OpenAI completion routes of a sim: parse, hand the request to the engine, write tokens.

Timing comes from the engine model (`pdplane.sim.engine`, stepped by `pdplane.sim.runner`):
the handler waits for the engine's progress notifications (first token, every
`stream_interval` tokens, the end) and writes what was generated since the last one, one SSE
event per token and choice (`n` > 1: `pdplane.sim.answers`). A prefill for a remote decode
(`do_remote_decode`) keeps its blocks under a new transfer id (and in push mode pushes them
to the named decode); a decode with `do_remote_prefill` loads them (`pdplane.sim.kvload`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from itertools import accumulate
from typing import Any

from aiohttp import web

from pdplane.core.kv_params import KvParamsError
from pdplane.sim.answers import Answer, answer_of
from pdplane.sim.engine import EngineRequest, Phase
from pdplane.sim.kvflow import KvIntent, classify, producer_params
from pdplane.sim.kvload import KvLoader, LoadContext
from pdplane.sim.protocol import SimApiError, SimRequest, parse_request
from pdplane.sim.records import RequestRecord
from pdplane.sim.responses import ResponseWriter
from pdplane.sim.state import SimState
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
        answers = [
            answer_of(s.tokenizer, req, intent, c.role, req.seed_of(i)) for i in range(req.n)
        ]
        # One engine request for all choices, as long as the longest (vLLM runs one per
        # choice, sharing the prompt's blocks; the sim's timing follows the longest).
        ids = max((a.ids for a in answers), key=len)
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
                record.first_token_at = time.time()
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
            for i, answer in enumerate(answers):
                writer.stopped_by(answer.stop, i)
            kv_out = None
            if producer:
                assert intent is not None
                held, kv_out = await self._hold(ereq, req, intent, record)
            if stream is not None:
                response = await self._stream(request, stream, req, writer, ereq, answers, record)
            else:
                response = await self._whole(request, req, writer, ereq, answers, record, kv_out)
            s.metrics.e2e.add((loop.time() - started) * c.time_scale)
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            # The client left. Before the hold, the request is aborted (below); after it, the
            # engine had finished the request and its connector holds the KV for a decode, as
            # vLLM's does: an abort of a finished request frees nothing. The blocks wait for
            # AbortTransfer (the gateway's) or the hold timeout.
            raise
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
        transfer_id = intent.transfer_id or uuid.uuid4().hex
        held = HeldTransfer(transfer_id, intent.request_id, ereq.blocks, req.prompt_tokens)
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
        answers: list[Answer],
        record: RequestRecord,
        kv_out: dict[str, Any] | None,
    ) -> web.StreamResponse:
        s = self._s
        if record.fault == "stall":
            await _forever()
        if record.fault == "drop":
            _drop(request)
            return web.Response(status=500)
        while ereq.phase != Phase.DONE:
            await s.runner.progress(ereq)
        choices = []
        for a in answers:
            n = min(ereq.num_output, len(a.ids))
            text = "".join(a.pieces[:n])
            if req.echo_prompt is not None:
                text = req.echo_prompt + text
            logprobs = None
            if req.logprobs is not None:
                assert s.tokenizer is not None
                logprobs = req.logprobs.of(s.tokenizer, a.ids[:n], a.tokens[:n], 0)
            choices.append((text, a.ids[:n], logprobs))
        record.tokens_sent = ereq.num_output
        return web.json_response(writer.full(choices, kv_out))

    async def _stream(
        self,
        request: web.Request,
        response: web.StreamResponse,
        req: SimRequest,
        writer: ResponseWriter,
        ereq: EngineRequest,
        answers: list[Answer],
        record: RequestRecord,
    ) -> web.StreamResponse:
        """Streams the choices' tokens on `response` (prepared, its headers sent), one chunk
        per token and choice, the choices of one engine step in index order (as vLLM streams
        `n` > 1). Faults count tokens per choice."""
        s = self._s
        total = max(len(a.ids) for a in answers)
        # completions' text_offset: vLLM advances it by the tokens' own text, not by the
        # text streamed (which lags the tokens while stop strings hold some back)
        offsets = [list(accumulate(map(len, a.tokens), initial=0)) for a in answers]

        def chunk(k: int, i: int) -> bytes:
            a = answers[k]
            logprobs = None
            if req.logprobs is not None and s.tokenizer is not None:
                logprobs = req.logprobs.of(s.tokenizer, [a.ids[i]], [a.tokens[i]], offsets[k][i])
            return writer.token_chunk(a.pieces[i], i == len(a.ids) - 1, a.ids[i], logprobs, k)

        strike = min(s.faults.fail_after_tokens, total) if record.fault else -1
        try:
            head = writer.role_chunk(req.n)
            if req.echo_prompt is not None:
                echo = b"".join(
                    writer.token_chunk(req.echo_prompt, False, index=k) for k in range(req.n)
                )
                head = echo if head is None else head + echo
            if head is not None:
                await response.write(head)
            if strike == 0:
                # Cut inside the first token's event, its first half written: an engine
                # killed while it writes (the client has headers and no whole token).
                event = chunk(0, 0)
                await response.write(event[: len(event) // 2])
                return await self._strike(request, response, record)
            sent = 0
            while True:
                ready = ereq.num_output
                if strike >= 0 and ready >= strike > sent:
                    ready = strike
                if ready > sent:
                    out = b"".join(
                        chunk(k, i)
                        for i in range(sent, ready)
                        for k in range(len(answers))
                        if i < len(answers[k].ids)
                    )
                    await response.write(out)
                    record.tokens_sent = sent = ready
                    kill_at = s.faults.kill_after_tokens
                    if kill_at and sent >= kill_at and s.kill is not None:
                        s.kill()  # the instance dies: this connection is cut with the rest
                        await _forever()
                if sent == strike:
                    return await self._strike(request, response, record)
                if sent >= total:
                    break
                if ereq.phase == Phase.DONE:
                    # The engine may have finished while a write waited on a slow client:
                    # what it produced meanwhile is still to be written (vLLM keeps it too).
                    if sent >= ereq.num_output:
                        break
                    continue
                await s.runner.progress(ereq)
            if req.include_usage:
                await response.write(
                    writer.usage_chunk(sum(min(sent, len(a.ids)) for a in answers))
                )
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
