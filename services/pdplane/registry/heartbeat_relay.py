"""A host's heartbeats, sent to the registry in one message a tick instead of one per instance.

The registry spends ~110-170 us of CPU in gRPC Python per message it reads and answers, against
~10-30 us of store work per heartbeat (docs/benchmarks/registry.md): 10,000 instances heart-
beating once a second are more messages than one Python process can read. `HeartbeatRelay`
runs in a host's `pdplane registry-relay`: the instances on the host keep their
`HeartbeatStream` to it, and it sends the latest heartbeat of each instance to the registry
once a tick (`flush_interval_s`, the heartbeat interval by default) as one `HeartbeatBatch`
over one `HeartbeatBatchStream` — for an 8-GPU host, one message a second instead of eight.

What an instance sees: each heartbeat is answered at once with the registry's last answer for
its lease (lease TTL, state: DRAINING reaches it one tick later than without the relay). The
first heartbeat of a lease the relay has no answer for yet (a new lease, or one the registry
refused last time) goes to the registry within `FIRST_WINDOW_S` and is answered with the
registry's own answer; so a refusal (NOT_FOUND: register again, INVALID_ARGUMENT, UNAVAILABLE)
ends the instance's stream with the registry's status at its next heartbeat, as HeartbeatStream
would have. When the link to the registry has been
down, or a batch unanswered, for `stale_after_s`, the relay stops vouching: heartbeats are
answered UNAVAILABLE and the instances' clients retry, as they do when a registry goes away
(an unanswered batch also makes the relay open the link again).

The registry renews a lease when the batch arrives, up to one tick after the instance's
heartbeat: with the defaults (TTL 5 s, 1 s ticks) a lease has 4-5 s of slack instead of 5.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from pdplane.core.grpc.auth import AuthPolicy
from pdplane.core.grpc.util import refusal
from pdplane.registry._backoff import Backoff
from pdplane.registry.servicer import MAX_HEARTBEAT_BATCH
from pdplane.v1 import registry_pb2, registry_pb2_grpc

__all__ = ["FIRST_WINDOW_S", "HEARTBEAT_STREAM", "HeartbeatRelay", "heartbeat_stream_handler"]

HEARTBEAT_STREAM = "/pdplane.v1.Registry/HeartbeatStream"

log = logging.getLogger(__name__)

#: How long the first heartbeat of a new lease waits for others to share its message (s): a
#: fleet starting up sends a few batches, not one message per instance.
FIRST_WINDOW_S = 0.005
#: Pause before the link to the registry is opened again after it broke (s), doubling up to
#: the maximum while it keeps breaking.
_RELINK_S, _RELINK_MAX_S = 0.1, 2.0
#: The same reason for a broken link is logged again only after this long (s).
_RELOG_S = 60.0
_CODES = {code.value[0]: code for code in grpc.StatusCode}

#: One lease held by one instance: (instance_id, lease_id).
_Key = tuple[str, str]


def _unavailable(why: str) -> registry_pb2.HeartbeatOutcome:
    return registry_pb2.HeartbeatOutcome(code=grpc.StatusCode.UNAVAILABLE.value[0], details=why)


class HeartbeatRelay:
    """Collects the heartbeats of the streams it serves and sends them to the registry in
    batches (see the module docstring for what an instance sees).

    `stub()` gives the registry stub to use now; `relink()` is called when the link broke, to
    move to another replica. `metadata` goes with the batch stream (the relay's bearer token).
    `flush_interval_s`: seconds between batches; `stale_after_s`: seconds the link may be down
    or a batch unanswered before heartbeats are answered UNAVAILABLE; `on_vouching(bool)` is
    awaited when that starts or ends (the relay's health).
    Counters for tests: `batches_sent`, `heartbeats_sent` (non-empty batches only).
    """

    def __init__(
        self,
        stub: Callable[[], registry_pb2_grpc.RegistryStub],
        metadata: tuple[tuple[str, str], ...],
        flush_interval_s: float,
        stale_after_s: float,
        relink: Callable[[], None] = lambda: None,
        on_vouching: Callable[[bool], Awaitable[None]] | None = None,
    ) -> None:
        self._stub = stub
        self._metadata = metadata
        self._interval_s = flush_interval_s
        self._stale_after_s = stale_after_s
        self._relink = relink
        self._on_vouching = on_vouching
        self._vouching = True
        self._link_error = ""  # why the last link broke (said to instances it leaves waiting)
        self._logged: tuple[str, float] = ("", 0.0)  # the last reason logged, and when
        self._backoff = Backoff(_RELINK_S, _RELINK_MAX_S)
        self._pending: dict[_Key, registry_pb2.HeartbeatRequest] = {}
        self._answers: dict[_Key, registry_pb2.HeartbeatResponse] = {}
        self._waiters: dict[_Key, list[asyncio.Future[registry_pb2.HeartbeatOutcome]]] = {}
        self._open: collections.Counter[_Key] = collections.Counter()
        # Batches sent and not answered yet: (monotonic send time, their keys), oldest first.
        self._in_flight: collections.deque[tuple[float, list[_Key]]] = collections.deque()
        self._wake = (
            asyncio.Event()
        )  # a heartbeat waits for its lease's first answer, or the tick moved
        self._down_since: float | None = None  # the link broke then and is not back
        self._next_tick = 0.0  # time.monotonic() of the next batch of every pending heartbeat
        self.batches_sent = 0
        self.heartbeats_sent = 0

    # ------------------------------------------------------------------ the instances' side

    def opened(self, key: _Key) -> None:
        """A stream started heartbeating for `key`."""
        self._open[key] += 1

    def closed(self, key: _Key) -> None:
        """A stream for `key` ended: once none is left, nothing more is sent or kept for it."""
        self._open[key] -= 1
        if self._open[key] <= 0:
            del self._open[key]
            self._pending.pop(key, None)
            self._answers.pop(key, None)

    async def beat(self, request: registry_pb2.HeartbeatRequest) -> registry_pb2.HeartbeatOutcome:
        """The outcome to answer `request` with (see the module docstring); it is sent with
        the next batch."""
        key = (request.instance_id, request.lease_id)
        self._pending[key] = request
        answer = self._answers.get(key)
        if answer is not None:
            if self._stale():
                why = f" (last: {self._link_error})" if self._link_error else ""
                return _unavailable(
                    f"the heartbeat relay has had no answer from the registry for "
                    f"{self._stale_after_s:.1f} s{why}"
                )
            return registry_pb2.HeartbeatOutcome(response=answer)
        waiter: asyncio.Future[registry_pb2.HeartbeatOutcome] = (
            asyncio.get_running_loop().create_future()
        )
        self._waiters.setdefault(key, []).append(waiter)
        self._wake.set()
        return await waiter

    def _silent_since(self) -> float | None:
        """Since when (monotonic) the registry has answered nothing it owes: the link is down
        or the oldest batch in flight is unanswered; None when all is answered."""
        if self._down_since is not None:
            return self._down_since
        return self._in_flight[0][0] if self._in_flight else None

    def _stale(self) -> bool:
        since = self._silent_since()
        return since is not None and time.monotonic() - since > self._stale_after_s

    # -------------------------------------------------------------------- the registry's side

    async def run(self) -> None:
        """Keeps the batch stream open and sends a batch every tick until cancelled."""
        while True:
            call = self._stub().HeartbeatBatchStream(metadata=self._metadata)
            reader = asyncio.ensure_future(self._read(call))
            reader.add_done_callback(lambda _: self._wake.set())  # a broken link ends _send
            try:
                await self._send(call, reader)
            except (grpc.RpcError, asyncio.InvalidStateError, ConnectionError) as exc:
                self._broken(exc)
                self._fail_in_flight(
                    f"the heartbeat relay lost its registry link: {self._link_error}"
                )
                self._relink()
            finally:
                reader.cancel()
                call.cancel()
            await self._publish_vouching()
            await asyncio.sleep(self._backoff.next_delay())

    def _broken(self, exc: BaseException) -> None:
        """Notes (and logs, once per reason a minute) why the link broke."""
        if isinstance(exc, grpc.aio.AioRpcError):
            code = exc.code()
            why = f"{code.name}: {exc.details()}"
            if code == grpc.StatusCode.UNAUTHENTICATED:
                why += " (the registry refused the relay's --token)"
            elif code == grpc.StatusCode.UNIMPLEMENTED:
                why += " (the registry has no HeartbeatBatchStream: upgrade it before its relays)"
        else:
            why = str(exc) or type(exc).__name__
        self._link_error = why
        now = time.monotonic()
        if why != self._logged[0] or now - self._logged[1] > _RELOG_S:
            self._logged = (why, now)
            log.warning("heartbeat batch stream to the registry broke: %s", why)

    async def _publish_vouching(self) -> None:
        """Tells `on_vouching` when the relay starts or stops vouching for its leases."""
        vouching = not self._stale()
        if vouching != self._vouching:
            self._vouching = vouching
            if self._on_vouching is not None:
                await self._on_vouching(vouching)

    async def _send(self, call: Any, reader: asyncio.Future[None]) -> None:
        self._next_tick = time.monotonic()  # a new link is tried at once (an empty batch)
        while True:
            remaining = self._next_tick - time.monotonic()
            if remaining > 0 and not self._wake.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), remaining)
            if reader.done():
                reader.result()  # raises what ended the link
                raise ConnectionError("the registry ended the heartbeat batch stream")
            await self._publish_vouching()
            # Only this link's own batches count: a link opened after an outage must get to
            # send before it can be judged.
            if self._in_flight and time.monotonic() - self._in_flight[0][0] > self._stale_after_s:
                raise ConnectionError(f"a batch unanswered for {self._stale_after_s:.1f} s")
            if self._wake.is_set():
                await asyncio.sleep(FIRST_WINDOW_S)
                self._wake.clear()
            if time.monotonic() >= self._next_tick:
                keys = list(self._pending)
                self._next_tick = max(self._next_tick + self._interval_s, time.monotonic())
                if not keys and not self._in_flight:
                    # Nothing to send: an empty batch keeps the link's answers (and so the
                    # relay's health and its instances' next first answers) current.
                    self._in_flight.append((time.monotonic(), []))
                    await call.write(registry_pb2.HeartbeatBatch())
                    continue
            else:  # only the heartbeats waiting for their lease's first answer
                keys = [key for key in self._pending if key in self._waiters]
            await self._write(call, keys)

    async def _write(self, call: Any, keys: list[_Key]) -> None:
        for start in range(0, len(keys), MAX_HEARTBEAT_BATCH):
            chunk = keys[start : start + MAX_HEARTBEAT_BATCH]
            batch = registry_pb2.HeartbeatBatch(heartbeats=[self._pending.pop(k) for k in chunk])
            self._in_flight.append((time.monotonic(), chunk))
            await call.write(batch)
            self.batches_sent += 1
            self.heartbeats_sent += len(chunk)

    async def _read(self, call: Any) -> None:
        async for result in call:
            _, keys = self._in_flight.popleft()
            self._down_since = None
            self._backoff.reset()
            await self._publish_vouching()
            for key, outcome in zip(keys, result.outcomes, strict=True):
                waiters = self._waiters.pop(key, [])
                if outcome.code:
                    # Its next heartbeat waits for a fresh answer: this refusal, again.
                    self._answers.pop(key, None)
                elif key in self._open:
                    self._answers[key] = outcome.response
                    self._within_ttl(outcome.response.lease_ttl_ms)
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(outcome)

    def _within_ttl(self, ttl_ms: int) -> None:
        # A lease is renewed up to a tick after its instance's heartbeat: ticks of a third of
        # the shortest TTL granted keep every lease at least two ticks from expiring.
        if ttl_ms and self._interval_s > ttl_ms / 3000:
            self._interval_s = ttl_ms / 3000
            self._next_tick = min(self._next_tick, time.monotonic() + self._interval_s)
            self._wake.set()  # the sender waits for the old tick
            log.warning(
                "the registry grants leases of %d ms: batches now every %.0f ms (a third of "
                "it) instead of --flush-interval-ms",
                ttl_ms,
                self._interval_s * 1000,
            )

    def _fail_in_flight(self, why: str) -> None:
        # Heartbeats sent on the broken link are lost: each is sent again with its instance's
        # next one; a heartbeat waiting for its first answer is answered UNAVAILABLE now.
        if self._down_since is None:
            self._down_since = self._silent_since() or time.monotonic()
        self._in_flight.clear()
        outcome = _unavailable(why)
        for waiters in self._waiters.values():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(outcome)
        self._waiters.clear()


def heartbeat_stream_handler(relay: HeartbeatRelay, auth: AuthPolicy) -> grpc.RpcMethodHandler:
    """`Registry/HeartbeatStream` served by the relay: one answer per heartbeat, in order; a
    refusal ends the stream with the registry's status and details. UNAUTHENTICATED, before
    any heartbeat is read, for a caller without `auth`'s credentials."""

    # A coroutine function (not a callable object): gRPC runs anything else on its thread pool.
    async def heartbeat_stream(_requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        why = refusal(auth, HEARTBEAT_STREAM, context.invocation_metadata())
        if why is not None:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, f"{why} (at the host's heartbeat relay)"
            )
        key: _Key | None = None
        try:
            while (request := await context.read()) is not grpc.aio.EOF:
                if key != (request.instance_id, request.lease_id):  # the first, or a new lease
                    if key is not None:
                        relay.closed(key)
                    key = (request.instance_id, request.lease_id)
                    relay.opened(key)
                outcome = await relay.beat(request)
                if outcome.code:
                    context.set_code(_CODES.get(outcome.code, grpc.StatusCode.UNKNOWN))
                    context.set_details(outcome.details)
                    return
                await context.write(outcome.response)
        finally:
            if key is not None:
                relay.closed(key)

    return grpc.stream_stream_rpc_method_handler(
        heartbeat_stream,
        request_deserializer=registry_pb2.HeartbeatRequest.FromString,
        response_serializer=registry_pb2.HeartbeatResponse.SerializeToString,
    )
