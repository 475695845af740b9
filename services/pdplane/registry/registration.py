"""Keeps one instance registered: register, heartbeat with load, re-register, deregister.

Thread-based so that it runs unchanged inside vLLM's engine process, the scheduler and the
gateway. Every RPC has a deadline (the heartbeat stream a watchdog) and every wait is
interruptible by `stop()`. Heartbeats go as messages on one long-lived `HeartbeatStream` per
instance (one request and one answer a second, no per-call setup); a registry without it
(UNIMPLEMENTED) gets unary `Heartbeat` calls instead.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import grpc

from pdplane.core.grpc import util as grpc_util
from pdplane.registry._backoff import Backoff
from pdplane.registry.failover import FAILOVER_CODES, RegistryEndpoints
from pdplane.v1 import instance_pb2, registry_pb2

__all__ = ["RegistrationClient"]

log = logging.getLogger(__name__)

_RPC_TIMEOUT_S = 2.0
#: Shorter for the goodbye: an unreachable registry expires the lease by itself anyway.
_DEREGISTER_TIMEOUT_S = 1.0
#: Errors that no retry soon will fix; retried slowly so that e.g. an ALREADY_EXISTS clears
#: once the previous holder's lease expires.
_PERMANENT = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
}
_PERMANENT_RETRY_S = 5.0
#: ALREADY_EXISTS: the id's previous lease is still live (this process restarted before it
#: expired). Retried often so that the instance is back within about a second of the expiry.
_HELD_RETRY_S = 1.0


def _is_idle(load: instance_pb2.LoadReport) -> bool:
    return load.num_running == 0 and load.num_waiting == 0 and load.inflight_transfers == 0


class RegistrationClient:
    """Registers `spec` with the registry at `registry` and keeps its lease.

    `registry` is "host:port", or several replicas' "h1:port,h2:port": the client uses one at
    a time and moves to the next when it is unreachable (UNAVAILABLE, a deadline, a heartbeat
    unanswered for longer than the RPC deadline). `load_fn` is called (in the client's threads)
    before each heartbeat and returns the load report to send; None sends an empty report.
    `token` is the registry's bearer token, `tls_ca` a PEM file to verify the registry's TLS
    certificate; `lease_ttl_ms` asks for a lease TTL (0 = the registry's default); `stream`
    False sends unary heartbeats.

    `start()` returns at once; a daemon thread registers, then heartbeats at the interval the
    registry grants. On NOT_FOUND (lease unknown, e.g. the registry restarted) it registers
    again at once; while the registry is unreachable it retries with backoff (0.1 s .. 0.5 s).
    A Register retried after its deadline carries the same request id and is granted the lease
    the registry had granted the call whose answer was lost.
    """

    def __init__(
        self,
        registry: str,
        spec: instance_pb2.InstanceSpec,
        load_fn: Callable[[], instance_pb2.LoadReport] | None = None,
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        lease_ttl_ms: int = 0,
        stream: bool = True,
    ) -> None:
        self._spec = instance_pb2.InstanceSpec()
        self._spec.CopyFrom(spec)
        self._load_fn = load_fn
        self._metadata = grpc_util.token_metadata(token)
        self._lease_ttl_ms = lease_ttl_ms
        self._endpoints = RegistryEndpoints(registry, tls_ca, grpc_util.FAST_RECONNECT_OPTIONS)
        self._stream = stream
        self._call: grpc.Call | None = None
        self._lock = threading.Lock()
        self._lease_id = ""
        self._request_id = secrets.token_hex(16)  # of the next Register (registry.proto)
        self._interval_s = 1.0
        self._state: instance_pb2.InstanceState.ValueType = instance_pb2.INSTANCE_STATE_UNSPECIFIED
        self._registered = threading.Event()
        self._stopping = threading.Event()
        self._draining = False
        self._last_load = instance_pb2.LoadReport()
        self._thread: threading.Thread | None = None
        self.last_error: str = ""
        self.registrations = 0  # how many times a lease was granted (re-registers included)
        self.heartbeats = 0  # heartbeats answered
        self.last_answer_at = 0.0  # time.monotonic() of the last answered heartbeat
        self.failovers = 0  # moves to another registry replica
        self._misses = 0  # replicas that failed since the last answered heartbeat
        self._unanswered_since_log = False  # said that heartbeats fail; not said they are back

    @property
    def registry(self) -> str:
        """The registry replica the client talks to now."""
        return self._endpoints.address

    @property
    def instance_id(self) -> str:
        """The registered instance id (from the spec)."""
        return self._spec.instance_id

    @property
    def state(self) -> instance_pb2.InstanceState.ValueType:
        """The last InstanceState seen from the registry (UNSPECIFIED when not registered)."""
        with self._lock:
            return self._state

    @property
    def lease_id(self) -> str:
        """The current lease id; empty while not registered."""
        with self._lock:
            return self._lease_id

    def start(self) -> None:
        """Starts the background register + heartbeat thread; returns immediately."""
        if self._thread is not None:
            raise RuntimeError("RegistrationClient already started")
        self._thread = threading.Thread(
            target=self._run, name=f"pdplane-registration-{self.instance_id}", daemon=True
        )
        self._thread.start()

    def wait_registered(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds until the instance holds a lease; True if it does."""
        return self._registered.wait(timeout)

    def stop(self, drain: bool = False, drain_timeout: float = 30.0) -> None:
        """Deregisters and joins the thread; returns within about `drain_timeout` + 5 s.

        With `drain`, the instance is first marked DRAINING (listed, never scheduled) and keeps
        heartbeating until `load_fn` reports it idle (no running, waiting or in-flight transfer)
        or `drain_timeout` seconds pass; then it is removed. Never raises on RPC errors.
        """
        if drain and self._registered.is_set():
            self._drain(drain_timeout)
        self._halt()
        lease = self.lease_id
        if lease:
            self._deregister(lease, drain=False)
        self._endpoints.close()

    def abandon(self) -> None:
        """Stops heartbeating without deregistering, as a killed process would: the
        registry removes the instance when its lease lapses (fault injection). Joins the
        thread; never raises."""
        self._halt()
        self._endpoints.close()

    def _halt(self) -> None:
        """Stops the heartbeat thread (its open call cancelled) and joins it."""
        self._stopping.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not None:
            self._thread.join(timeout=_RPC_TIMEOUT_S + 1.0)

    def _drain(self, timeout: float) -> None:
        with self._lock:
            self._draining = True
            lease = self._lease_id
        self._deregister(lease, drain=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._registered.is_set():
            if self._load_fn is None or _is_idle(self._read_load()):
                return
            self._stopping.wait(min(0.1, max(0.0, deadline - time.monotonic())))

    def _deregister(self, lease_id: str, drain: bool) -> None:
        request = registry_pb2.DeregisterRequest(
            instance_id=self.instance_id, lease_id=lease_id, drain=drain
        )
        response = None
        for _ in self._endpoints.addresses:
            try:
                response = self._endpoints.stub.Deregister(
                    request,
                    timeout=_DEREGISTER_TIMEOUT_S,
                    metadata=self._metadata,
                    wait_for_ready=not self._endpoints.several,
                )
                break
            except grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, grpc.Call) else None
                log.warning("deregister of %s failed: %s", self.instance_id, code)
                if code not in FAILOVER_CODES:
                    return
                self._endpoints.failover()
        if response is None:
            return
        with self._lock:
            self._state = response.state
            if not drain:
                self._lease_id = ""
                self._registered.clear()

    def _run(self) -> None:
        backoff = Backoff()
        while not self._stopping.is_set():
            try:
                delay = self._step()
                backoff.reset()
            except grpc.RpcError as exc:
                delay = self._on_error(exc, backoff)
            except Exception:  # a failing load_fn must not kill the lease
                log.exception("registration loop of %s", self.instance_id)
                delay = backoff.next_delay()
            self._stopping.wait(delay)

    def _step(self) -> float:
        """One register or heartbeat; returns the delay (s) until the next step."""
        with self._lock:
            lease, draining = self._lease_id, self._draining
        if not lease:
            if draining:  # a draining instance that lost its lease must not come back
                return self._interval_s
            self._register()
            # The first heartbeat at once: a replayed Register (its first answer was lost) is
            # granted a lease that has run since that first call, up to a deadline ago.
            return 0.0
        if self._stream:
            self._heartbeat_stream(lease)
            return 0.0
        load = self._read_load()
        request = registry_pb2.HeartbeatRequest(
            instance_id=self.instance_id, lease_id=lease, load=load
        )
        response = self._endpoints.stub.Heartbeat(
            request,
            timeout=min(_RPC_TIMEOUT_S, self._interval_s),
            metadata=self._metadata,
            wait_for_ready=not self._endpoints.several,
        )
        self._answered(lease, response)
        return self._interval_s

    def _answered(self, lease: str, response: registry_pb2.HeartbeatResponse) -> None:
        with self._lock:
            if self._lease_id == lease:
                self._state = response.state
        self.heartbeats += 1
        self.last_answer_at = time.monotonic()
        self._misses = 0
        if self._unanswered_since_log:
            self._unanswered_since_log = False
            log.info("registry %s answers %s's heartbeats again", self.registry, self.instance_id)

    def _heartbeat_stream(self, lease: str) -> None:
        """Heartbeats on one stream until it breaks (raises grpc.RpcError), the lease changes
        or the client stops. gRPC's request thread runs `requests` (paced at the interval); this
        thread reads the answers. A heartbeat unanswered for the RPC deadline cancels the
        stream (a hung replica), which the caller treats as a reason to fail over."""
        interval = self._interval_s
        deadline_s = min(_RPC_TIMEOUT_S, max(interval, 0.5))
        unanswered: deque[float] = deque()
        holder: list[grpc.Call] = []

        def requests() -> Iterator[registry_pb2.HeartbeatRequest]:
            while not self._stopping.is_set() and self.lease_id == lease:
                if unanswered and time.monotonic() - unanswered[0] > deadline_s:
                    self.last_error = f"heartbeat unanswered for {deadline_s:.1f} s"
                    if holder:
                        holder[0].cancel()
                    return
                unanswered.append(time.monotonic())
                yield registry_pb2.HeartbeatRequest(
                    instance_id=self.instance_id, lease_id=lease, load=self._read_load()
                )
                self._stopping.wait(interval)

        call = self._endpoints.stub.HeartbeatStream(requests(), metadata=self._metadata)
        holder.append(call)
        with self._lock:
            self._call = call
        try:
            for response in call:
                if unanswered:
                    unanswered.popleft()
                self._answered(lease, response)
        finally:
            with self._lock:
                self._call = None
            call.cancel()

    def _read_load(self) -> instance_pb2.LoadReport:
        """The load to report; a failing `load_fn` repeats the last good report, so that a
        broken load probe never costs the instance its lease."""
        if self._load_fn is None:
            return self._last_load
        try:
            self._last_load = self._load_fn()
        except Exception:
            log.exception("load_fn of %s failed; reporting the last load", self.instance_id)
        return self._last_load

    def _register(self) -> None:
        # The same request_id until a lease is granted: a retry of a Register whose answer was
        # lost (its deadline passed) is granted the lease the registry gave the lost one.
        request = registry_pb2.RegisterRequest(
            spec=self._spec, lease_ttl_ms=self._lease_ttl_ms, request_id=self._request_id
        )
        response = self._endpoints.stub.Register(
            request,
            timeout=_RPC_TIMEOUT_S,
            metadata=self._metadata,
            wait_for_ready=not self._endpoints.several,
        )
        with self._lock:
            self._lease_id = response.lease_id
            self._request_id = secrets.token_hex(16)  # the next registration is a new one
            self._interval_s = max(response.heartbeat_interval_ms, 10) / 1000.0
            self._state = instance_pb2.INSTANCE_STATE_SERVING
            self.registrations += 1
            self.last_error = ""
        self._registered.set()
        log.info(
            "registered %s with %s (lease %s)", self.instance_id, self.registry, response.lease_id
        )

    def _on_error(self, exc: grpc.RpcError, backoff: Backoff) -> float:
        code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
        self.last_error = f"{code.name}: {exc.details() if isinstance(exc, grpc.Call) else exc}"
        if code == grpc.StatusCode.NOT_FOUND:
            # The registry no longer knows the lease (restart or expiry): register again now.
            with self._lock:
                self._lease_id = ""
                self._state = instance_pb2.INSTANCE_STATE_UNSPECIFIED
            self._registered.clear()
            log.info("lease of %s lost; registering again", self.instance_id)
            return 0.0
        if code == grpc.StatusCode.UNIMPLEMENTED and self._stream:
            log.info("registry %s has no HeartbeatStream; unary heartbeats", self.registry)
            self._stream = False
            return 0.0
        if code in _PERMANENT:
            log.error("registry rejected %s: %s", self.instance_id, self.last_error)
            return _HELD_RETRY_S if code == grpc.StatusCode.ALREADY_EXISTS else _PERMANENT_RETRY_S
        if code in FAILOVER_CODES and self._endpoints.several and not self._stopping.is_set():
            self._endpoints.failover()
            self.failovers += 1
            self._misses += 1
            log.info("registry unreachable for %s; trying %s", self.instance_id, self.registry)
            if self._misses % len(self._endpoints.addresses):
                return 0.05  # the next replica is probably up: do not wait the full backoff
        if code in FAILOVER_CODES and not self._unanswered_since_log:
            # Once per outage: an instance whose heartbeats fail must say so where it logs.
            self._unanswered_since_log = True
            log.warning(
                "heartbeats of %s unanswered (%s); retrying", self.instance_id, self.last_error
            )
        return backoff.next_delay()
