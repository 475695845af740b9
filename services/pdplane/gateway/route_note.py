"""Where a request went and what the scheduler predicted: the access log line and, when the
client asks (`X-Pdplane-Route: 1`), response headers.

One `RouteNote` per request. The relay writes the latest decision into it (a retry or a
take-over replaces it); the endpoints turn it into

- one line on the logger `pdplane.gateway.access` at the end of the request (`--access-log`,
  on by default as `vllm serve`'s is), e.g.::

    127.0.0.1 "POST /v1/completions" 200 req=pdp-...-1 model=tiny prompt_tokens=600 exact
    prefill=prefill-0 cached=512 decode=decode-1 cached=0 ms=84.2
    reason="prefill kv_aware: cached=512/600 tokens; decode ..."

  (`prefill=skipped decode=decode-1 cached=512` when decode computed the prompt's rest
  itself; `cached=unknown` and no prefill hit when the prompt's ids, hence its prefix
  hashes, were not known: routing by load, `estimated`)

- with the request header `X-Pdplane-Route: 1`, the response headers `X-Pdplane-Prefill` and
  `X-Pdplane-Decode` (`<instance id>; cached_tokens=<n>`; prefill `none` when decode computed
  the prompt itself), `X-Pdplane-Prompt-Tokens` (`<n>; exact` or `; estimated`) and
  `X-Pdplane-Route-Reason` (the scheduler's reason). Instance ids are the operator's names, so
  they are shown only to a client that asks (behind the gateway's API key, when it has one).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdplane.scheduler import Decision

__all__ = ["ROUTE_HEADER", "RouteNote", "access_log"]

access_log = logging.getLogger("pdplane.gateway.access")

#: Request header asking for the routing response headers ("1" or "true").
ROUTE_HEADER = b"x-pdplane-route"
#: Longest reason sent in a header (characters).
_MAX_REASON = 512


def _header_text(text: str) -> str:
    """`text` as a header value: printable Latin-1, bounded."""
    return "".join(c if c.isprintable() and ord(c) < 256 else "?" for c in text[:_MAX_REASON])


@dataclass(slots=True)
class RouteNote:
    """The routing of one request: its latest decision and how its prompt length was known."""

    decision: Decision | None = None
    prompt_tokens: int = 0
    exact: bool = False

    def headers(self) -> dict[str, str]:
        """The routing response headers (empty before a decision)."""
        d = self.decision
        if d is None:
            return {}
        prefill = (
            "none"
            if d.prefill is None
            else f"{d.prefill.instance_id}; cached_tokens={d.prefill_cached_tokens}"
        )
        return {
            "x-pdplane-prefill": prefill,
            "x-pdplane-decode": f"{d.decode.instance_id}; cached_tokens={d.decode_cached_tokens}",
            "x-pdplane-prompt-tokens": (
                f"{self.prompt_tokens}; {'exact' if self.exact else 'estimated'}"
            ),
            "x-pdplane-route-reason": _header_text(d.reason),
        }

    def log_line(
        self,
        client: str,
        method: str,
        path: str,
        status: int,
        request_id: str,
        model: str,
        ms: float,
    ) -> None:
        """Writes the request's access log line (INFO on `pdplane.gateway.access`)."""
        d = self.decision
        if d is None:
            route = "unscheduled"
        elif not self.exact:
            # No prompt ids, no prefix hashes: nothing was predicted (the scheduler's 0s).
            prefill = "skipped" if d.prefill is None else d.prefill.instance_id
            route = f"prefill={prefill} decode={d.decode.instance_id} cached=unknown"
        elif d.prefill is None:  # decode computed the prompt's rest itself
            route = f"prefill=skipped decode={d.decode.instance_id} cached={d.decode_cached_tokens}"
        else:
            route = (
                f"prefill={d.prefill.instance_id} cached={d.prefill_cached_tokens} "
                f"decode={d.decode.instance_id} cached={d.decode_cached_tokens}"
            )
        access_log.info(
            '%s "%s %s" %d req=%s model=%s prompt_tokens=%d %s %s ms=%.1f reason="%s"',
            client,
            method,
            path,
            status,
            request_id,
            model or "-",
            self.prompt_tokens,
            "exact" if self.exact else "estimated",
            route,
            ms,
            "" if d is None else d.reason,
        )
