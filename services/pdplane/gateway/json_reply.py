"""The non-streamed answer: decode's JSON as it came, with the fleet's prefix cache hit.

A decode that dies before its answer is complete is `DecodeLost` when the request may run
again (`Request.restartable`: the client has seen nothing, so running it again on another
pair is exact, seeded sampling included); the relay's loop then schedules it again.
"""

from __future__ import annotations

import time

from pdplane.gateway import usage_details
from pdplane.gateway.errors import bad_gateway, gateway_timeout
from pdplane.gateway.migration import Loss
from pdplane.gateway.replies import JsonReply
from pdplane.gateway.request import DecodeLost, Request
from pdplane.gateway.upstream import UpstreamResponse, UpstreamTimeout, UpstreamUnreachable

__all__ = ["json_reply"]


async def json_reply(r: Request, resp: UpstreamResponse) -> JsonReply:
    """Decode's whole answer on `resp` (its status < 400) as the client's reply; the attempt
    succeeded once it is read. TTFT is observed when prefill computed the first token (vLLM
    counts it then), end-to-end latency always (s).

    Raises DecodeLost (connection lost, the request may run again), GatewayError (502 lost,
    504 silent past `--upstream-timeout-s`)."""
    name = r.decode.instance_id
    try:
        body = await r.relay.upstream.read(resp)
    except UpstreamUnreachable as exc:
        message = f"decode instance {name} failed before answering: {exc}"
        if r.restartable():
            raise DecodeLost(name, Loss("lost", 502, message)) from None
        raise bad_gateway(message) from None
    except UpstreamTimeout:
        raise gateway_timeout(f"decode instance {name} went silent for {r.timeout_s:g} s") from None
    r.care.succeeded()
    metrics = r.relay.metrics
    if r.prefilled_at:
        metrics.ttft.observe(r.prefilled_at - r.started)
    body = usage_details.rewrite_json(body, r.cached, r.prefill is None)
    metrics.e2e.observe(time.perf_counter() - r.started)
    return JsonReply(200, body, resp.headers.get("content-type", "application/json"))
