"""Registers the instance (once, from the scheduler side) once its OpenAI server answers.

vLLM builds the connector before its HTTP server listens; registering at that moment would let
the gateway route to an instance that refuses connections. So a thread first waits for
`<url>/health` to answer 200 and for every TP rank's worker to be ready (pre-connected to the
peers it will need, see peer_watch.py), then hands over to `RegistrationClient` (register,
heartbeat with the engine's load, re-register after a registry restart, deregister on
shutdown).

While registered, the same thread keeps checking that the HTTP server still listens (a TCP
connect every 0.25 s: no request, no access-log line): when the connection is refused twice in a
row while this engine lives on, the instance deregisters, so that the gateway stops routing to a
server that no longer exists within about half a second instead of the lease TTL. (An API server
that dies is caught sooner still by `pdplane.connector.lifeline`.) A slow or timed-out connect
is not taken as death: a busy server accepts late.
"""

from __future__ import annotations

import atexit
import logging
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdplane.connector.config import ConnectorConfig
from pdplane.core.grpc import util as grpc_util
from pdplane.registry.client import RegistrationClient
from pdplane.v1 import instance_pb2

__all__ = ["InstanceRegistration", "build_spec"]

log = logging.getLogger(__name__)

_HEALTH_POLL_S = 0.5
_LIVENESS_POLL_S = 0.25
_CONNECT_TIMEOUT_S = 1.0
_REFUSALS_BEFORE_DEREGISTER = 2
#: beyond the pre-connect's own bound, how long registration waits for the workers (s)
_READY_GRACE_S = 5.0
_KV_TRANSFER = "pdplane.v1.KvTransfer"


def build_spec(
    config: ConnectorConfig,
    instance_id: str,
    role: instance_pb2.Role.ValueType,
    model: str,
    layout: instance_pb2.KvLayout,
    max_model_len: int,
    tp_size: int,
    version: str,
    tokenizer_hash: str = "",
) -> instance_pb2.InstanceSpec:
    """The InstanceSpec this instance registers with (`tokenizer_hash`: of the tokenizer it
    publishes, "" = none)."""
    return instance_pb2.InstanceSpec(
        instance_id=instance_id,
        role=role,
        model=model,
        url=(config.url or "").rstrip("/"),
        kv_endpoint=config.kv_endpoint(),
        transport=config.registry_transport,
        tp_size=tp_size,
        kv_layout=layout,
        max_model_len=max_model_len,
        version=version,
        labels=config.labels,
        tokenizer_hash=tokenizer_hash,
    )


def _probe(url: str) -> str:
    """GET <url>/health: "ok" (200), "refused" (nothing listens) or "unknown" (anything else)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2.0) as resp:
            return "ok" if resp.status == 200 else "unknown"
    except urllib.error.URLError as exc:
        return "refused" if isinstance(exc.reason, ConnectionRefusedError) else "unknown"
    except ConnectionRefusedError:
        return "refused"
    except (OSError, ValueError):
        return "unknown"


def _healthy(url: str) -> bool:
    return _probe(url) == "ok"


def _worker_state(target: str, tls_ca: str | None) -> str:
    """The worker server at `target`: "ready" (`pdplane.v1.KvTransfer` SERVING), "starting"
    or "absent" (nothing answers there: no worker of this instance on this host)."""
    try:
        with grpc_util.channel(target, tls_ca) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=_KV_TRANSFER), timeout=2.0
            )
    except grpc.RpcError as exc:
        unavailable = isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.UNAVAILABLE
        return "absent" if unavailable else "starting"
    return "ready" if answer.status == health_pb2.HealthCheckResponse.SERVING else "starting"


def _refused(url: str) -> bool:
    """True when nothing listens at `url`'s host and port (connection refused)."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", port), _CONNECT_TIMEOUT_S):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # timed out, unreachable: not proof that the server is gone
        return False


class InstanceRegistration:
    """Waits for the instance's HTTP server, then keeps it registered until `stop()`.

    Args:
        config: connector settings (registry address, token, TLS CA, URL, lease TTL).
        spec: what to register.
        load_fn: the heartbeat's load report (called from the registration thread).
    """

    def __init__(
        self,
        config: ConnectorConfig,
        spec: instance_pb2.InstanceSpec,
        load_fn: Callable[[], instance_pb2.LoadReport],
    ) -> None:
        assert config.registry is not None
        self.client = RegistrationClient(
            config.registry,
            spec,
            load_fn,
            token=config.registry_token,
            tls_ca=config.registry_tls_ca,
            lease_ttl_ms=config.lease_ttl_ms,
        )
        self._url = spec.url
        self._config = config
        self._tp_size = spec.tp_size
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._wait_then_register, name="pdplane-registration-wait", daemon=True
        )

    def start(self) -> None:
        """Returns at once; registration starts when `<url>/health` answers 200."""
        self._thread.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        """Deregisters (if registered) and stops the threads; idempotent, never raises."""
        with self._lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
        self.client.stop()  # deregisters when registered; closes the channel either way
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=3.0)

    def _wait_then_register(self) -> None:
        while not self._stopping.is_set():
            if _healthy(self._url):
                self._wait_workers_ready()
                with self._lock:
                    if self._stopping.is_set():
                        return
                    self.client.start()
                log.info("registering %s with %s", self.client.instance_id, self._url)
                self._watch_liveness()
                return
            self._stopping.wait(_HEALTH_POLL_S)

    def _wait_workers_ready(self) -> None:
        # Each worker pre-connects to the peers it will need before it reports ready (health
        # of pdplane.v1.KvTransfer on its own server), so that the scheduler sends this
        # instance no request before that. Bounded: an instance registers anyway once the
        # pre-connect's own bound is past. Workers start their servers before vLLM's HTTP
        # server answers, so one that nothing answers for is not on this host: not waited for.
        targets = [self._config.kv_local_address(r) for r in range(max(self._tp_size, 1))]
        deadline = time.monotonic() + self._config.preconnect_timeout_s + _READY_GRACE_S
        waiting = list(targets)
        while waiting and not self._stopping.is_set():
            states = {t: _worker_state(t, self._config.tls_ca) for t in waiting}
            waiting = [t for t, state in states.items() if state == "starting"]
            if not waiting or time.monotonic() >= deadline:
                break
            self._stopping.wait(_HEALTH_POLL_S)
        if waiting:
            log.warning("workers at %s not ready in time; registering anyway", waiting)

    def _watch_liveness(self) -> None:
        refusals = 0
        while not self._stopping.wait(_LIVENESS_POLL_S):
            refusals = refusals + 1 if _refused(self._url) else 0
            if refusals >= _REFUSALS_BEFORE_DEREGISTER:
                log.warning(
                    "%s: nothing answers at %s any more; deregistering",
                    self.client.instance_id,
                    self._url,
                )
                self.stop()
                return
