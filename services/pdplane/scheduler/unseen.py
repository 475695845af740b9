"""Peers' decisions estimated but not received yet: the "unseen" load of the in-flight exchange.

A burst decides faster than one stream hop, so each replica assumes that its peers decide as
it does (`pdplane.scheduler.inflight_exchange`, module doc): an own assignment also counts once per
followed peer on its instances, until the second update from that peer since the assignment
has arrived (the first may have left before it), at most `lag_s` seconds. An assignment made
before a peer's first update ever counts for that peer until `lag_s` has passed.

Kept incrementally, so that a decision reads a count per instance instead of re-deriving it
from every recent assignment: per followed peer, the assignments still counting for it (in
time order; since the updates received from a peer only grow, those that stop counting leave
from the front), and per instance the sum over peers. Every instance whose count changes is
told to the in-flight tracker (`touch`), whose decision tables then rewrite its row.
One thread (the event loop of the exchange and the decisions) uses it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

__all__ = ["UnseenPeers"]


@dataclass(frozen=True, slots=True)
class _Mark:
    at: float  # clock seconds
    instance_ids: tuple[str, ...]
    received: dict[str, int]  # peer replica id -> updates received from it by then


class _PeerWindow:
    """One followed peer's marks still counting: `before` (made before its first update:
    until `lag_s`) and `since` (until its second update after them)."""

    __slots__ = ("before", "since")

    def __init__(self) -> None:
        self.before: deque[_Mark] = deque()
        self.since: deque[_Mark] = deque()


class UnseenPeers:
    """The estimate (`UnseenEstimate` of `pdplane.scheduler.inflight`).

    `followed()` returns the replica ids of the peers followed now; `touch(instance_ids)` is
    told of every instance whose count changed. `lag_s`: the longest an assignment counts.
    """

    def __init__(
        self,
        followed: Callable[[], Collection[str]],
        lag_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._followed = followed
        self._lag_s = lag_s
        self._clock = clock
        self.touch: Callable[[Iterable[str]], None] | None = None
        self._received: dict[str, int] = {}  # peer replica id -> updates received from it
        self._recent: deque[_Mark] = deque()  # own assignments within lag_s, oldest first
        self._windows: dict[str, _PeerWindow] = {}  # followed peer -> its counting marks
        self._counts: dict[str, int] = {}  # instance id -> estimate

    def count(self, instance_id: str) -> int:
        """Estimated peer assignments to `instance_id` (as of the last `refresh`)."""
        return self._counts.get(instance_id, 0)

    def counted(self) -> list[str]:
        """The instances with a non-zero estimate now."""
        return list(self._counts)

    def assigned(self, instance_ids: Iterable[str]) -> None:
        """An own assignment to these instances was made now (counted only while a peer is
        followed, as the estimate stands for peers' decisions)."""
        self.refresh()
        if not self._windows:
            return
        ids = tuple(i for i in instance_ids if i)
        mark = _Mark(self._clock(), ids, dict(self._received))
        self._recent.append(mark)
        for origin, window in self._windows.items():
            (window.since if origin in mark.received else window.before).append(mark)
            self._add(ids, 1)

    def received(self, origin: str) -> None:
        """An update from peer `origin` arrived: its marks made before its previous update
        stop counting."""
        count = self._received[origin] = self._received.get(origin, 0) + 1
        window = self._windows.get(origin)
        if window is None:
            return
        since = window.since
        while since and count - since[0].received[origin] >= 2:
            self._add(since.popleft().instance_ids, -1)

    def refresh(self) -> None:
        """Drops marks older than `lag_s` and follows the peers that came or went."""
        followed = self._followed()
        windows = self._windows
        if len(followed) != len(windows) or any(o not in windows for o in followed):
            self._follow(set(followed))
        recent = self._recent
        if not recent:
            return
        horizon = self._clock() - self._lag_s
        if recent[0].at > horizon:
            return
        while recent and recent[0].at <= horizon:
            recent.popleft()
        for window in windows.values():
            for marks in (window.before, window.since):
                while marks and marks[0].at <= horizon:
                    self._add(marks.popleft().instance_ids, -1)

    def _follow(self, followed: set[str]) -> None:
        for origin in [o for o in self._windows if o not in followed]:
            gone = self._windows.pop(origin)
            for mark in (*gone.before, *gone.since):
                self._add(mark.instance_ids, -1)
        for origin in followed - self._windows.keys():
            window = self._windows[origin] = _PeerWindow()
            count = self._received.get(origin, 0)
            for mark in self._recent:
                if origin not in mark.received:
                    window.before.append(mark)
                elif count - mark.received[origin] < 2:
                    window.since.append(mark)
                else:
                    continue
                self._add(mark.instance_ids, 1)

    def _add(self, instance_ids: tuple[str, ...], delta: int) -> None:
        counts = self._counts
        for instance_id in instance_ids:
            left = counts.get(instance_id, 0) + delta
            if left:
                counts[instance_id] = left
            else:
                del counts[instance_id]
        if self.touch is not None:
            self.touch(instance_ids)
