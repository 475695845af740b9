"""Decode's leg of a stream whose first token came from prefill (`--first-token prefill`).

The client already has prefill's token (`pdplane.gateway.splice`), so a decode that cannot
be reached is not a 502 but a take-over: another decode, picked by the scheduler with the
failed ones excluded, continues the stream computing the whole prompt itself (prefill's KV is
for the lost one). The failed try is released failed and prefill's KV freed, as for any retry.
"""

from __future__ import annotations

from pdplane.gateway.bodies import continuation_body
from pdplane.gateway.legs import open_decode, refused_mid_stream
from pdplane.gateway.replies import RetryElsewhere
from pdplane.gateway.request import Request
from pdplane.gateway.schedule import schedule
from pdplane.gateway.splice import FirstToken
from pdplane.gateway.upstream import UpstreamResponse
from pdplane.gateway.validation import COMPLETIONS

__all__ = ["open_continuation"]


async def open_continuation(
    r: Request, first: FirstToken, kv: bytes, token_ids: bool
) -> UpstreamResponse:
    """Decode's response headers for the continuation of prefill's first token: decode
    continues from prefill's prompt ids + `first`, loading prefill's KV (`kv`: its
    kv_transfer_params, JSON bytes). `token_ids`: decode streams its tokens' ids
    (`Splice.token_ids`).

    A decode that cannot be reached is replaced within the request's retries left (waiting
    for room if need be). Anything else before decode's first byte is the answer: raises
    GatewayError, whose event ends the stream (the status and decode's message for 4xx, 502
    for 5xx and for no retry left, 504 for silence).
    """
    prompt = first.decode_prompt
    body = continuation_body(r.req, prompt, kv, token_ids)
    while True:
        try:
            resp = await open_decode(r, body, COMPLETIONS)
        except RetryElsewhere as failed:
            r.care.settle(failed)  # Release first, so the next Schedule excludes it
            if r.tries_left <= 0:
                raise failed.error from None
            r.tries_left -= 1
            r.retrying(failed, "another decode takes over")
            r.failed = failed
            await schedule(r, queue=True)
            body = continuation_body(r.req, prompt, None, token_ids)  # no KV: computes it
            continue
        if resp.status < 400:
            return resp
        await refused_mid_stream(r, resp)
