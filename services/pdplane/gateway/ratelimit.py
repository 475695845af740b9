"""Rate limits per API key: requests per second and tokens per minute (token buckets).

A key's `requests_per_s` is a bucket of `max(1, requests_per_s)` requests refilled at that
rate; its `tokens_per_min` a bucket of that many tokens refilled at `tokens_per_min / 60` per
second. A request takes 1 request and `prompt + max_tokens` tokens (its budget, as OpenAI
counts a request against TPM) from both or from neither; when it ends, the tokens it did not
use are given back (`settle`: actual usage). A request larger than the whole token bucket is
let through when the bucket is full and leaves it in debt, so it is never refused forever.
A refusal is a 429 with OpenAI's rate-limit body and `Retry-After` = the seconds until the
bucket holds enough again.

Limits are per gateway replica (state in memory): with N gateways behind a load balancer,
give each key 1/N of the limit (docs/flow-control.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pdplane.gateway.errors import GatewayError, too_many_requests
from pdplane.gateway.tenants import Identity

__all__ = ["RateLimiter", "TokenBucket"]

#: Buckets kept at most; past it, full (idle) buckets are dropped (a trusted proxy may name
#: any number of tenants).
_MAX_BUCKETS = 10_000


class TokenBucket:
    """`capacity` units refilled at `rate` per second; `level` may go negative (a debt)."""

    __slots__ = ("capacity", "level", "rate", "updated")

    def __init__(self, capacity: float, rate: float, now: float) -> None:
        self.capacity = capacity
        self.rate = rate
        self.level = capacity
        self.updated = now

    def refill(self, now: float) -> None:
        """Adds what accrued since the last refill, up to `capacity`."""
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` can be taken (0 = now); a call after `refill`. An amount over
        the capacity waits for a full bucket."""
        need = min(amount, self.capacity) - self.level
        return max(0.0, need / self.rate)

    def give(self, amount: float) -> None:
        """Returns `amount` unused units (never past `capacity`)."""
        self.level = min(self.capacity, self.level + amount)


@dataclass(slots=True)
class _KeyBuckets:
    requests: TokenBucket | None
    tokens: TokenBucket | None
    limits: tuple[float | None, float | None]


class RateLimiter:
    """Token buckets per identity bucket (`Identity.bucket`).

    Args:
        on_limited: called with (tenant, "requests" | "tokens") for each refusal (metrics).
        clock: monotonic seconds (tests may pass their own).
    """

    def __init__(
        self,
        on_limited: Callable[[str, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._buckets: dict[str, _KeyBuckets] = {}
        self._on_limited = on_limited
        self._clock = clock

    def take(self, who: Identity, tokens: int) -> None:
        """Takes one request and `tokens` tokens for `who`, or raises GatewayError 429 with
        `Retry-After` (the seconds until both buckets hold enough) and takes nothing."""
        if not who.bucket:
            return
        b = self._get(who)
        now = self._clock()
        waits: list[tuple[float, str, str]] = []
        if b.requests is not None:
            b.requests.refill(now)
            if (w := b.requests.wait_s(1)) > 0:
                waits.append(
                    (w, "requests", f"requests per second (RPS): Limit {who.requests_per_s:g}")
                )
        if b.tokens is not None:
            b.tokens.refill(now)
            if (w := b.tokens.wait_s(tokens)) > 0:
                used = b.tokens.capacity - b.tokens.level
                waits.append(
                    (
                        w,
                        "tokens",
                        f"tokens per min (TPM): Limit {who.tokens_per_min:g}, Used {used:.0f}, "
                        f"Requested {tokens}",
                    )
                )
        if waits:
            wait_s, kind, words = max(waits)
            if self._on_limited is not None:
                self._on_limited(who.tenant, kind)
            raise self._refusal(who, wait_s, kind, words)
        if b.requests is not None:
            b.requests.level -= 1
        if b.tokens is not None:
            b.tokens.level -= tokens

    def settle(self, who: Identity, charged: int, used: int) -> None:
        """Gives back `charged - used` tokens when a request of `who` ended having used `used`
        (prompt + completion tokens) of the `charged` it took."""
        if not who.bucket or used >= charged:
            return
        b = self._buckets.get(who.bucket)
        if b is not None and b.tokens is not None:
            b.tokens.refill(self._clock())
            b.tokens.give(charged - used)

    def _refusal(self, who: Identity, wait_s: float, kind: str, words: str) -> GatewayError:
        return too_many_requests(
            f"Rate limit reached for tenant {who.tenant!r} on {words}.", wait_s, kind
        )

    def _get(self, who: Identity) -> _KeyBuckets:
        limits = (who.requests_per_s, who.tokens_per_min)
        b = self._buckets.get(who.bucket)
        if b is not None and b.limits == limits:
            return b
        now = self._clock()
        if b is None and len(self._buckets) >= _MAX_BUCKETS:
            self._drop_idle(now)
        rps, tpm = limits
        fresh = _KeyBuckets(
            TokenBucket(max(1.0, rps), rps, now) if rps else None,
            TokenBucket(tpm, tpm / 60.0, now) if tpm else None,
            limits,
        )
        if b is not None:
            # Limits changed by a reload: keep what was used, within the new capacities.
            for old, new in ((b.requests, fresh.requests), (b.tokens, fresh.tokens)):
                if old is not None and new is not None:
                    old.refill(now)
                    new.level = min(new.capacity, new.capacity - (old.capacity - old.level))
        self._buckets[who.bucket] = fresh
        return fresh

    def _drop_idle(self, now: float) -> None:
        for name, b in list(self._buckets.items()):
            full = True
            for bucket in (b.requests, b.tokens):
                if bucket is not None:
                    bucket.refill(now)
                    full = full and bucket.level >= bucket.capacity
            if full:
                del self._buckets[name]
