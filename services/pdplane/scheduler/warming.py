"""Prefix warming: copy a prefix many requests read onto an idle prefill, before it is needed.

kv_aware sends each request to the prefill predicted fastest for it. For a long prefix that
every request reads (one system prompt for the whole fleet) that is always the instance already
holding it: computing the prompt anywhere else costs a full cold prefill. Every choice is right
for its own request, yet all of them queue on one prefill while the others idle; a load-only
policy spreads the same requests and so, by accident, copies the prefix everywhere.

The warmer makes that copy on purpose and charges it to idle capacity, never to a request:
when a prefix of at least `min_tokens` tokens was read by at least `requests_per_holder`
requests per prefill holding it within the last `window_s` seconds, and a compatible prefill
that does not hold it has nothing to do, the decision carries a `WarmHint`: the caller sends
that prefill the prompt's first `prefix_tokens` tokens as a one-token request of its own, and
the engine's prefix cache keeps them. Requests that read the prefix then find it on one more
instance, and the policy spreads them by predicted latency as usual.

The demand rule keeps one-session prefixes (multi-turn history, an agent's scratchpad: read
once per turn) from being copied; the idle rule keeps warming from competing with requests
(at and above saturation no prefill is idle, so nothing is warmed). One warm of a prefix at a
time: the next is considered `WARM_SETTLE_S` after the first is predicted done. A hot prefix
that found no idle prefill (or enough holders) is looked at again `WARM_RECHECK_S` later, not
on every decision that reads it: the look is a few passes over the prefill side, and demand is
measured over seconds.

Source of the idea: replication of hot prefixes in cache-aware routers (SGLang's router
balances by load once caches are imbalanced; Preble replicates prompts whose load exceeds
one instance). This one copies ahead of demand with spare prefill capacity only.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

__all__ = [
    "WARM_MIN_TOKENS",
    "WARM_RECHECK_S",
    "WARM_REQUESTS_PER_HOLDER",
    "WARM_SETTLE_S",
    "WARM_WINDOW_S",
    "PrefixWarmer",
    "WarmSettings",
]

#: Defaults of `WarmSettings` (--kv-warm-min-tokens, --kv-warm-window-s,
#: --kv-warm-requests-per-holder).
WARM_MIN_TOKENS = 1024
WARM_WINDOW_S = 10.0
WARM_REQUESTS_PER_HOLDER = 8
#: After a warm is predicted done, how long before the same prefix may be warmed again (s): the
#: time its KV events take to reach the prefix index, with room to spare.
WARM_SETTLE_S = 1.0
#: How long a hot prefix that found no prefill to warm is not looked at again (s): short next
#: to the window demand is counted over, long next to a decision (it saves ~30 us of passes
#: over the prefill side on each decision reading that prefix).
WARM_RECHECK_S = 0.1


@dataclass(frozen=True, slots=True)
class WarmSettings:
    """When a prefix is copied (module doc).

    Attributes:
        min_tokens: the shortest prefix worth copying (tokens); 0 turns warming off.
        window_s: how far back reads of a prefix count (s).
        requests_per_holder: reads within `window_s` per prefill holding the prefix that make
            it worth one more holder.
    """

    min_tokens: int = WARM_MIN_TOKENS
    window_s: float = WARM_WINDOW_S
    requests_per_holder: int = WARM_REQUESTS_PER_HOLDER

    def __post_init__(self) -> None:
        if self.min_tokens < 0 or self.window_s <= 0 or self.requests_per_holder < 1:
            raise ValueError(
                "warm settings: min_tokens >= 0, window_s > 0, requests_per_holder >= 1"
            )


class PrefixWarmer:
    """Counts reads of prefixes and says when one deserves another holder (module doc).

    A prefix is named by the hash of its last full KV cache block (the request's chained block
    hash, so it names the whole prefix). Memory: one deque per prefix read in the window,
    forgotten when its reads age out (checked on each `read`, a bounded sweep per call).
    """

    def __init__(self, settings: WarmSettings) -> None:
        self.settings = settings
        self._reads: dict[int, collections.deque[float]] = {}
        # prefix -> when it may be looked at again (s): its warm predicted done and settled, or
        # a recent look that found nothing to do
        self._quiet_until: dict[int, float] = {}
        self._sweep: collections.deque[int] = collections.deque()

    @property
    def enabled(self) -> bool:
        return self.settings.min_tokens > 0

    def read(self, prefix: int, now: float) -> int:
        """Counts one read of `prefix` at `now` (s); returns its reads within the window."""
        horizon = now - self.settings.window_s
        reads = self._reads.get(prefix)
        if reads is None:
            reads = self._reads[prefix] = collections.deque()
            self._sweep.append(prefix)
        reads.append(now)
        while reads and reads[0] < horizon:
            reads.popleft()
        self._forget_some(horizon)
        return len(reads)

    def _forget_some(self, horizon: float) -> None:
        # Two prefixes per read: the map never holds more than the window's reads, about.
        for _ in range(min(2, len(self._sweep))):
            prefix = self._sweep.popleft()
            reads = self._reads.get(prefix)
            if reads is None:
                continue
            while reads and reads[0] < horizon:
                reads.popleft()
            if reads:
                self._sweep.append(prefix)
            else:
                del self._reads[prefix]
                self._quiet_until.pop(prefix, None)

    def wanted(self, reads: int, holders: int) -> bool:
        """Whether `reads` in the window justify more than `holders` prefills holding it."""
        return reads >= self.settings.requests_per_holder * max(holders, 1)

    def busy(self, prefix: int, now: float) -> bool:
        """Whether `prefix` is not to be looked at at `now` (s): a warm of it is predicted
        still running or settling, or a look found nothing to do within `WARM_RECHECK_S`."""
        return self._quiet_until.get(prefix, -1.0) > now

    def started(self, prefix: int, done_at: float) -> None:
        """Notes a warm of `prefix` predicted done at `done_at` (s): quiet until it settled."""
        self._quiet_until[prefix] = done_at + WARM_SETTLE_S

    def nothing_to_do(self, prefix: int, now: float) -> None:
        """Notes that a look at hot `prefix` at `now` (s) found no prefill to warm."""
        self._quiet_until[prefix] = now + WARM_RECHECK_S

    def __len__(self) -> int:
        return len(self._reads)
