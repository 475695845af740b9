"""Prefix warms: the scheduler's `WarmHint`s sent to their prefill as requests of their own.

The scheduler proposes a warm when many requests read a prefix that an idle prefill does not
hold (`pdplane.scheduler.warming`, docs/prefix-warming.md). The gateway that got
the hint is the one holding the prompt's token ids, so it sends the prefill
`POST /v1/completions` with the first `prefix_tokens` ids as the prompt, `max_tokens` 1 and no
`kv_transfer_params`: the engine computes the prefix, answers one token and keeps the blocks in
its prefix cache (the connector holds nothing for a request without `do_remote_decode`). Its
KV events then tell the scheduler's prefix index that the instance holds the prefix.

Warming is an optimisation, so it never delays or fails a client's request: each warm runs in
a task of its own, at most `MAX_RUNNING` at once and one per instance (a hint beyond that is
dropped and counted: an instance slower than the scheduler predicts, or stopped, is not sent
the same prefix again while its first warm runs), its answer is read and dropped, and a
failure is counted and logged at DEBUG. Each warm has its own `X-Request-Id`
(`pdplane-warm-<n>`), so engine logs name it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Mapping, Sequence

from pdplane.gateway.metrics import GatewayMetrics
from pdplane.gateway.upstream import UpstreamClient, UpstreamTimeout, UpstreamUnreachable
from pdplane.scheduler import WarmHint

__all__ = ["MAX_RUNNING", "PrefixWarms"]

log = logging.getLogger(__name__)

#: Warms in flight at once per gateway; hints beyond are dropped (the next read proposes again).
MAX_RUNNING = 8


class PrefixWarms:
    """Sends prefix warms (module doc).

    Args:
        upstream: the gateway's pooled HTTP client.
        headers: the legs' headers (content type, the upstream bearer token).
        metrics: `pdplane_gateway_prefix_warms_total{result}` is counted here.
        timeout_s: bound on one warm, headers and body (s).
    """

    def __init__(
        self,
        upstream: UpstreamClient,
        headers: Mapping[str, str],
        metrics: GatewayMetrics,
        timeout_s: float,
    ) -> None:
        self._upstream = upstream
        self._headers = headers
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._running: set[asyncio.Task[None]] = set()
        self._busy: set[str] = set()  # instances with a warm running
        self._seq = itertools.count(1)

    def send(self, model: str, prompt_ids: Sequence[int], hint: WarmHint) -> None:
        """Starts the warm of `hint` for a request of `model` ("" = the instance's default)
        whose prompt is `prompt_ids`; returns at once. Drops it (counted `dropped`) when
        `MAX_RUNNING` warms run, one runs on that instance already, or the ids are shorter
        than the hint's prefix."""
        tokens = hint.prefix_tokens
        instance = hint.instance.instance_id
        if (
            len(self._running) >= MAX_RUNNING
            or instance in self._busy
            or not 0 < tokens <= len(prompt_ids)
        ):
            self._metrics.prefix_warms.labels("dropped").inc()
            return
        body: dict[str, object] = {"prompt": list(prompt_ids[:tokens]), "max_tokens": 1}
        if model:
            body["model"] = model
        headers = {**self._headers, "x-request-id": f"pdplane-warm-{next(self._seq)}"}
        task = asyncio.create_task(
            self._warm(hint, json.dumps(body).encode(), headers), name="pdplane-prefix-warm"
        )
        self._running.add(task)
        self._busy.add(instance)

        def done(t: asyncio.Task[None]) -> None:
            self._running.discard(t)
            self._busy.discard(instance)

        task.add_done_callback(done)

    async def _warm(self, hint: WarmHint, body: bytes, headers: Mapping[str, str]) -> None:
        url = hint.instance.url + "/v1/completions"
        try:
            resp = await self._upstream.open(
                url,
                body,
                headers,
                read_timeout_s=self._timeout_s,
                total_timeout_s=self._timeout_s,
            )
            status = resp.status
            await self._upstream.read(resp)
        except (UpstreamUnreachable, UpstreamTimeout) as exc:
            log.debug("prefix warm of %s tokens on %s: %s", hint.prefix_tokens, url, exc)
            self._metrics.prefix_warms.labels("failed").inc()
            return
        if status != 200:
            log.debug("prefix warm of %s tokens on %s: HTTP %s", hint.prefix_tokens, url, status)
            self._metrics.prefix_warms.labels("failed").inc()
            return
        self._metrics.prefix_warms.labels("sent").inc()

    async def close(self) -> None:
        """Cancels the warms still running and waits for them (shutdown)."""
        running = list(self._running)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
