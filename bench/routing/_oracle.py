"""In-fleet routers: the oracle (knows every cache) and the seed proxy's random choice.

Both are P/D proxies inside the sim fleet's process, with the pdplane gateway's legs
(sequential dispatch, `kv_transfer_params` from `pdplane.core.kv_params`, the decode named on
the prefill leg so push mode works). No retries, no authentication: instruments, not products.

`random` is the seed proxy's choice: prefill and decode drawn at random (seeded), with no look
at load or KV room, the behaviour behind the seed's 1P7D pile-up.

The oracle:
For each request it tokenizes the prompt exactly as the sims do, looks its block keys up in
every prefill instance's prefix cache (direct reads, no events, no delay) and sends the
prefill leg where `uncached prompt tokens + uncached tokens it has sent there and not yet seen
answered` is lowest (ties: the longest hit); the decode leg goes to the decode instance with
the fewest requests it has sent and not yet seen finish (ties: the longest hit in its cache).
The legs are the same as the pdplane gateway's in sequential dispatch
(`kv_transfer_params` from `pdplane.core.kv_params`).
"""

from __future__ import annotations

import json
import random
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from pdplane.core.kv_params import PrefillRequestParams
from pdplane.sim.instance import SimInstance
from pdplane.sim.kv_cache import chain_hashes
from pdplane.sim.sim_fleet import SimFleet

__all__ = ["ROUTERS", "build_oracle_app"]

#: the in-fleet routers by name
ROUTERS = ("oracle", "random")

_SSE = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


class _Oracle:
    def __init__(self, fleet: SimFleet, mode: str = "oracle", seed: int = 0) -> None:
        if mode not in ROUTERS:
            raise ValueError(f"unknown in-fleet router {mode!r}; known: {', '.join(ROUTERS)}")
        self.mode = mode
        self.rng = random.Random(seed)
        self.prefills = [s for s in fleet.instances if s.config.role == "prefill"]
        self.decodes = [s for s in fleet.instances if s.config.role == "decode"]
        if not self.prefills or not self.decodes:
            raise ValueError("the oracle needs prefill and decode instances")
        first = self.prefills[0].state
        assert first.tokenizer is not None
        self.tokenizer = first.tokenizer
        self.block_size = first.config.block_size
        self.prefill_tokens = {s.instance_id: 0 for s in self.prefills}
        self.decode_requests = {s.instance_id: 0 for s in self.decodes}
        self.session: aiohttp.ClientSession | None = None

    def _prompt_ids(self, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            return self.tokenizer.encode_chat(body.get("messages") or [])
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return prompt
        return self.tokenizer.encode(prompt if isinstance(prompt, str) else "")

    @staticmethod
    def _hit(sim: SimInstance, keys: list[int], max_blocks: int) -> int:
        return len(sim.state.core.pool.longest_hit(keys, max_blocks))

    def pick(self, ids: list[int]) -> tuple[SimInstance, SimInstance, int]:
        """(prefill, decode, uncached prompt tokens at the chosen prefill)."""
        if self.mode == "random":
            return self.rng.choice(self.prefills), self.rng.choice(self.decodes), 0
        keys = chain_hashes(ids, self.block_size)
        max_blocks = (len(ids) - 1) // self.block_size
        best: tuple[float, int, SimInstance] | None = None
        uncached = len(ids)
        for p in self.prefills:
            hit = self._hit(p, keys, max_blocks) * self.block_size
            cost = self.prefill_tokens[p.instance_id] + len(ids) - hit
            if best is None or (cost, -hit) < (best[0], -best[1]):
                best, uncached = (cost, hit, p), len(ids) - hit
        assert best is not None
        decode = min(
            self.decodes,
            key=lambda d: (self.decode_requests[d.instance_id], -self._hit(d, keys, max_blocks)),
        )
        return best[2], decode, uncached

    async def relay(self, request: web.Request, chat: bool) -> web.StreamResponse:
        assert self.session is not None
        raw = await request.read()
        body = json.loads(raw)
        prefill, decode, uncached = self.pick(self._prompt_ids(body, chat))
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        leg = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
        leg.update(max_tokens=1, stream=False, n=1)
        if chat:
            leg["max_completion_tokens"] = 1
        leg["kv_transfer_params"] = PrefillRequestParams(
            rid, decode.instance_id, decode.kv_endpoint
        ).to_dict()
        path = request.path
        headers = {"X-Request-Id": rid}
        self.prefill_tokens[prefill.instance_id] += uncached
        self.decode_requests[decode.instance_id] += 1
        try:
            async with self.session.post(prefill.url + path, json=leg, headers=headers) as r:
                answer = await r.read()
                if r.status != 200:
                    return web.Response(
                        body=answer, status=r.status, content_type="application/json"
                    )
            self.prefill_tokens[prefill.instance_id] -= uncached
            uncached = 0
            params = json.loads(answer).get("kv_transfer_params")
            return await self._decode(
                request, decode, {**body, "kv_transfer_params": params}, path, headers
            )
        finally:
            self.prefill_tokens[prefill.instance_id] -= uncached
            self.decode_requests[decode.instance_id] -= 1

    async def _decode(
        self,
        request: web.Request,
        decode: SimInstance,
        body: dict[str, Any],
        path: str,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        assert self.session is not None
        async with self.session.post(decode.url + path, json=body, headers=headers) as r:
            if r.status != 200 or not body.get("stream"):
                return web.Response(
                    body=await r.read(), status=r.status, content_type="application/json"
                )
            out = web.StreamResponse(headers=_SSE)
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out


def build_oracle_app(fleet: SimFleet, mode: str = "oracle", seed: int = 0) -> web.Application:
    """An in-fleet router's aiohttp app (`/v1/chat/completions`, `/v1/completions`) over
    `fleet`; `mode` is one of `ROUTERS`."""
    oracle = _Oracle(fleet, mode, seed)

    async def start(_app: web.Application) -> None:
        oracle.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
        )

    async def close(_app: web.Application) -> None:
        if oracle.session is not None:
            await oracle.session.close()

    async def chat(request: web.Request) -> web.StreamResponse:
        return await oracle.relay(request, chat=True)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await oracle.relay(request, chat=False)

    async def models(_request: web.Request) -> web.Response:
        model = oracle.prefills[0].config.model
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(close)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    return app
