"""A whole pdplane deployment on one machine: registry, scheduler, gateway and an XpYd fleet of
vLLM CPU instances with the pdplane connector. Used by `pdplane up` and the end-to-end tests.

Start order and readiness: every port its own and free (else `PortsInUse` before anything
starts) ->
registry (gRPC health) -> scheduler (gRPC health) -> gateway (HTTP up) -> all vLLM instances in
parallel (/health) -> every instance listed in the registry -> gateway /health 200 (a usable
pair per model) -> the gateway routes the model precisely (it has fetched the tokenizer the
instances publish; at most `_PRECISE_WITHIN_S`, and not at all when they publish none). A
child counts as up only when the process answering is that child: each one gets its own
server id (`pdplane.core.server_id`), which the services' health answers and the
connector's KvTransfer health (inside the vLLM engine) carry. Shutdown stops the gateway first
(open streams finish on the engines, bounded), then the rest in reverse; every child is
stopped through its process group, so nothing outlives `stop()`.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
import httpx

from pdplane.core import defaults
from pdplane.core.grpc import util as grpc_util
from pdplane.core.listen import port_taken
from pdplane.launch.etcd import etcd_binary, member_argv
from pdplane.launch.process import (
    ManagedProcess,
    grpc_serving,
    http_ok,
    http_server_id,
    wait_until,
)
from pdplane.launch.sim_process import SimOptions, SimProcess
from pdplane.launch.vllm_cpu import KvRole, VllmCpuInstance, VllmCpuOptions
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc

__all__ = ["DemoRequestFailed", "Engine", "Fleet", "FleetSpec", "PortsInUse", "default_model_cache"]

#: One engine instance of the fleet: vLLM CPU, or the simulator standing in for it.
Engine = VllmCpuInstance | SimProcess

_TINY_MODEL_NAME = "tiny-llama"
#: Longest silence while waiting for a child to be ready (s).
_PROGRESS_EVERY_S = 20.0
#: Longest wait, once a pair serves, for the gateway to route the model precisely (s): its
#: fetch and check of the tokenizer the instances publish; past it, routing is by load until
#: the tokenizer arrives.
_PRECISE_WITHIN_S = 30.0


def default_model_cache() -> Path:
    """Where the tiny model is built: $PDPLANE_CACHE_DIR or ~/.cache/pdplane."""
    return defaults.cache_root() / "models"


class PortsInUse(RuntimeError):
    """Ports the fleet needs are taken (e.g. by another `pdplane up`); nothing was started."""


class _UpLike(Protocol):
    @property
    def model_fields_set(self) -> set[str]: ...  # the flags given (pydantic)

    prefill: int
    decode: int
    host: str
    gateway_port: int
    registry_port: int
    scheduler_port: int
    scheduler_metrics_port: int
    autoscale: bool
    autoscale_metrics_port: int
    vllm_base_port: int
    kv_base_port: int
    model: Path | None
    served_model_name: str | None
    vllm_args: str
    max_model_len: int
    prefill_policy: str
    decode_policy: str
    kv_profile: str
    kv_warm_min_tokens: int
    kv_warm_window_s: float
    kv_warm_requests_per_holder: int
    queue_timeout_s: float
    tenants: Path | None
    api_key: str | None
    inflight_budget: float
    max_queued_requests: int
    migration_limit: int
    migration_timeout_s: float
    drain_grace_s: float
    log_dir: Path
    ready_timeout_s: float
    etcd_port: int
    sim_profile: str

    @property
    def engine(self) -> str: ...

    @property
    def kv_mode(self) -> str: ...

    @property
    def store(self) -> str: ...

    @property
    def flow_policy(self) -> str: ...


def _set_flags(*pairs: tuple[str, object]) -> list[str]:
    """["--flag", "value", ...] for each (flag, value) whose value is set (not None)."""
    return [a for flag, value in pairs if value is not None for a in (flag, str(value))]


@dataclass
class FleetSpec:
    """What to start. Ports are fixed (the defaults of `pdplane up`) or chosen by the caller."""

    prefill: int = 1
    decode: int = 1
    host: str = "127.0.0.1"
    gateway_port: int = defaults.GATEWAY_PORT
    registry_port: int = defaults.REGISTRY_PORT
    scheduler_port: int = defaults.SCHEDULER_PORT
    #: The scheduler's Prometheus /metrics port; 0 = not served.
    scheduler_metrics_port: int = 0
    #: The autoscale controller's Prometheus /metrics port (served by `pdplane up` itself);
    #: 0 = no controller, or not served.
    autoscale_metrics_port: int = 0
    vllm_base_port: int = defaults.VLLM_BASE_PORT
    kv_base_port: int = defaults.KV_BASE_PORT
    model: Path | None = None
    served_model_name: str | None = None
    vllm_args: list[str] = field(default_factory=list)
    #: Tokens per request (prompt + output) of every vLLM instance.
    max_model_len: int = 1024
    prefill_policy: str = "kv_aware"
    decode_policy: str = "kv_aware"
    #: The engine profile the scheduler's kv_aware predicts latencies with (--kv-profile);
    #: None = the scheduler's default or its PDPLANE_KV_PROFILE.
    kv_profile: str | None = None
    #: The scheduler's prefix-warming flags (`--kv-warm-min-tokens`, `--kv-warm-window-s`,
    #: `--kv-warm-requests-per-holder`, docs/prefix-warming.md); None = its own default.
    kv_warm_min_tokens: int | None = None
    kv_warm_window_s: float | None = None
    kv_warm_requests_per_holder: int | None = None
    #: The gateway's `--queue-timeout-s` (how long a request waits for room on a full fleet);
    #: None = the gateway's own default or its PDPLANE_QUEUE_TIMEOUT_S.
    queue_timeout_s: float | None = None
    #: The gateway's `--tenants` file; None = none.
    tenants: Path | None = None
    #: The gateway's `--api-key` (comma-separated keys), given to it through its environment
    #: (never argv, which `ps` shows); None = none.
    api_key: str | None = None
    #: The gateway's `--inflight-budget`, `--flow-policy`, `--max-queued-requests`; None = its
    #: own default or its PDPLANE_* environment variable.
    inflight_budget: float | None = None
    flow_policy: str | None = None
    max_queued_requests: int | None = None
    #: The gateway's `--migration-limit`, `--migration-timeout-s`, `--drain-grace-s` (a
    #: stream whose decode is lost or drains continues on another); None = its own default.
    migration_limit: int | None = None
    migration_timeout_s: float | None = None
    drain_grace_s: float | None = None
    #: The gateway's `--shutdown-timeout-s`: on stop, open requests get this long to finish
    #: (the engines serve them meanwhile); a stream still open then ends with an error event
    #: saying the server is shutting down (s).
    gateway_shutdown_s: int = 10
    log_dir: Path = Path("logs")
    ready_timeout_s: float = 600.0
    #: Extra `VllmCpuOptions` fields for every instance (e.g. transfer_timeout_s in tests).
    vllm_options: dict[str, Any] = field(default_factory=dict)
    #: The registry's store; "etcd" also starts a local one-member etcd (client port
    #: `etcd_port`, peer port `etcd_port` + 1, data in a fresh folder under `log_dir`).
    store: str = "memory"
    etcd_port: int = 2379
    #: The fleet's shared bearer token (every service and instance) and the registry's admin
    #: token; None = an open fleet. Children get them through their environment, never argv.
    token: str | None = None
    admin_token: str | None = None
    #: "vllm": vLLM CPU instances; "sim": `pdplane sim` instances of `sim_profile` (no model)
    engine: str = "vllm"
    sim_profile: str = "tiny-cpu"
    #: the sims' context length (tokens) when `--max-model-len` was given; None = the profile's
    sim_max_model_len: int | None = None

    @classmethod
    def from_settings(
        cls, s: _UpLike, token: str | None = None, admin_token: str | None = None
    ) -> FleetSpec:
        """From `pdplane up`'s settings (`--vllm-args` is split like a shell would) and the
        fleet's tokens."""
        return cls(
            prefill=s.prefill,
            decode=s.decode,
            host=s.host,
            gateway_port=s.gateway_port,
            registry_port=s.registry_port,
            scheduler_port=s.scheduler_port,
            scheduler_metrics_port=s.scheduler_metrics_port,
            autoscale_metrics_port=s.autoscale_metrics_port if s.autoscale else 0,
            vllm_base_port=s.vllm_base_port,
            kv_base_port=s.kv_base_port,
            model=s.model,
            served_model_name=s.served_model_name,
            vllm_args=shlex.split(s.vllm_args),
            max_model_len=s.max_model_len,
            prefill_policy=s.prefill_policy,
            decode_policy=s.decode_policy,
            kv_profile=s.kv_profile,
            kv_warm_min_tokens=s.kv_warm_min_tokens,
            kv_warm_window_s=s.kv_warm_window_s,
            kv_warm_requests_per_holder=s.kv_warm_requests_per_holder,
            queue_timeout_s=s.queue_timeout_s,
            tenants=s.tenants,
            api_key=s.api_key,
            inflight_budget=s.inflight_budget,
            flow_policy=s.flow_policy,
            max_queued_requests=s.max_queued_requests,
            migration_limit=s.migration_limit,
            migration_timeout_s=s.migration_timeout_s,
            drain_grace_s=s.drain_grace_s,
            log_dir=s.log_dir,
            ready_timeout_s=s.ready_timeout_s,
            store=s.store,
            etcd_port=s.etcd_port,
            vllm_options={"connector_extra": {"mode": s.kv_mode}} if s.kv_mode != "pull" else {},
            token=token,
            admin_token=admin_token,
            engine=s.engine,
            sim_profile=s.sim_profile,
            sim_max_model_len=(s.max_model_len if "max_model_len" in s.model_fields_set else None),
        )

    def gateway_flags(self) -> list[str]:
        """The flow-control and migration flags the fleet's gateway is started with (those set:
        not None); the API keys go through its environment instead."""
        return _set_flags(
            ("--queue-timeout-s", self.queue_timeout_s),
            ("--tenants", self.tenants),
            ("--inflight-budget", self.inflight_budget),
            ("--flow-policy", self.flow_policy),
            ("--max-queued-requests", self.max_queued_requests),
            ("--migration-limit", self.migration_limit),
            ("--migration-timeout-s", self.migration_timeout_s),
            ("--drain-grace-s", self.drain_grace_s),
        )

    def scheduler_flags(self) -> list[str]:
        """The policy flags the fleet's scheduler is started with besides its policies and
        profile (those set: not None)."""
        return _set_flags(
            ("--kv-warm-min-tokens", self.kv_warm_min_tokens),
            ("--kv-warm-window-s", self.kv_warm_window_s),
            ("--kv-warm-requests-per-holder", self.kv_warm_requests_per_holder),
        )

    def client_key(self) -> str | None:
        """A key the fleet's gateway accepts (for the demo request): the first of `api_key`,
        else the first in the `tenants` file; None when it requires none. Raises ValueError
        naming the tenants file when it cannot be read or is invalid."""
        keys = [k.strip() for k in (self.api_key or "").split(",") if k.strip()]
        if keys:
            return keys[0]
        if self.tenants is None:
            return None
        from pdplane.gateway.tenants import load_tenants  # PyYAML: only with a tenants file

        listed = load_tenants(self.tenants).keys
        return listed[0].key if listed else None


class DemoRequestFailed(RuntimeError):
    """The demo request got no answer: the gateway's status and error message, or why the
    connection failed."""


def _pdplane(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdplane.cli.main", *args]


class Fleet:
    """Starts, supervises and stops one deployment described by a FleetSpec."""

    def __init__(self, spec: FleetSpec, say: Callable[[str], None] = lambda _m: None) -> None:
        self.spec = spec
        self._say = say
        self._services: list[ManagedProcess] = []
        self.instances: list[Engine] = []
        self._free_indices: list[int] = []  # of instances removed (their ports are free)
        self._next_index = 0
        self._cores = max(1, os.cpu_count() or 1)
        self.model_dir: Path | None = None
        self.model_name = ""
        self.ready_after_s = 0.0
        #: The gateway's routing of the served model once started: "precise" (KV-aware),
        #: "pending" (by load until it has the tokenizer the instances publish) or "load"
        #: (they publish none, or disagree), and why (its /health `routing_reason`).
        self.routing = "load"
        self.routing_reason = ""
        self._lock = threading.Lock()
        self._names: dict[Engine, str] = {}
        self._indices: dict[Engine, int] = {}
        self._reported_dead: set[Engine] = set()
        self._restarting: set[Engine] = set()
        #: registry, scheduler, gateway (etcd): where each answers and whether the answer comes
        #: from the process started last (its server id)
        self._answers: dict[ManagedProcess, tuple[str, Callable[[], bool]]] = {}
        self._restarting_services: set[ManagedProcess] = set()
        self._cancel: threading.Event | None = None
        #: Children get SIGTERM if this process dies (set by long-lived supervisors such as
        #: `pdplane up`, whose main thread starts them).
        self.die_with_parent = False

    # -- addresses --------------------------------------------------------------------------
    @property
    def registry_address(self) -> str:
        return f"{self.spec.host}:{self.spec.registry_port}"

    @property
    def scheduler_address(self) -> str:
        return f"{self.spec.host}:{self.spec.scheduler_port}"

    def service_addresses(self) -> tuple[str, ...]:
        """Where the fleet's gRPC services other than the registry listen ("host:port"): the
        scheduler and every instance's KvTransfer server; all take the shared token."""
        s = self.spec
        kv = [f"{s.host}:{s.kv_base_port + i}" for i in range(s.prefill + s.decode)]
        return (self.scheduler_address, *kv)

    @property
    def gateway_url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.gateway_port}"

    @property
    def scheduler_metrics_url(self) -> str:
        """The scheduler's Prometheus endpoint; "off" when not served."""
        port = self.spec.scheduler_metrics_port
        return f"http://{self.spec.host}:{port}/metrics" if port else "off"

    @property
    def autoscale_metrics_url(self) -> str:
        """The autoscale controller's Prometheus endpoint; "off" when not served."""
        port = self.spec.autoscale_metrics_port
        return f"http://{self.spec.host}:{port}/metrics" if port else "off"

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, cancel: threading.Event | None = None) -> None:
        """Starts everything and waits until the gateway serves a usable pair.

        Raises TimeoutError (after `ready_timeout_s`), ProcessDied (a RuntimeError) with the
        log's tail when a child exits during start-up, or Cancelled as soon as `cancel` is set
        (what started stays running: the caller then calls stop()).
        """
        started = time.monotonic()
        deadline = started + self.spec.ready_timeout_s
        self._cancel = cancel
        clash = self.port_clash()
        if clash:
            raise PortsInUse(clash)
        busy = self.busy_ports()
        if busy:
            listed = ", ".join(f"{port} ({what})" for port, what in busy)
            flags = ", ".join(dict.fromkeys(flag for _, _, flag in self.wanted_ports()))
            raise PortsInUse(
                f"ports in use on {self.spec.host}: {listed}; is another `pdplane up` running? "
                f"Stop it or choose other ports ({flags})"
            )
        self._resolve_model()
        self._start_services(deadline)
        for _ in range(self.spec.prefill):
            self._launch("kv_producer")
        for _ in range(self.spec.decode):
            self._launch("kv_consumer")
        for inst in list(self.instances):
            self._wait(
                lambda i=inst: self.instance_ready(i),  # type: ignore[misc]
                deadline,
                [inst.process],
                f"{self._names[inst]} to be healthy",
            )
            self._say(f"{self._names[inst]} healthy at {inst.url}")
        self.wait_registered(len(self.instances), max(1.0, deadline - time.monotonic()))
        self._wait(
            lambda: http_ok(f"{self.gateway_url}/health"),
            deadline,
            self._services,
            "the gateway to report a usable prefill/decode pair",
        )
        self._wait_routing(min(_PRECISE_WITHIN_S, max(0.0, deadline - time.monotonic())))
        self.ready_after_s = time.monotonic() - started

    def wanted_ports(self) -> list[tuple[int, str, str]]:
        """(port, what, flag) for every port the fleet binds: the one list of them, which the
        port check and its advice (the flags to change) both read. A flag is the `pdplane up`
        option (`FleetSpec` field) that sets the port."""
        s = self.spec
        wanted = [
            (s.registry_port, "registry", "--registry-port"),
            (s.scheduler_port, "scheduler", "--scheduler-port"),
            (s.gateway_port, "gateway", "--gateway-port"),
        ]
        if s.scheduler_metrics_port:
            metrics = (s.scheduler_metrics_port, "scheduler metrics", "--scheduler-metrics-port")
            wanted.append(metrics)
        if s.autoscale_metrics_port:
            wanted.append(
                (s.autoscale_metrics_port, "autoscale metrics", "--autoscale-metrics-port")
            )
        if s.store == "etcd":
            wanted += [
                (s.etcd_port, "etcd client", "--etcd-port"),
                (s.etcd_port + 1, "etcd peer", "--etcd-port"),
            ]
        names = [f"prefill-{i}" for i in range(s.prefill)]
        names += [f"decode-{i}" for i in range(s.prefill, s.prefill + s.decode)]
        for index, name in enumerate(names):
            wanted += [
                (s.vllm_base_port + index, f"{name} vLLM", "--vllm-base-port"),
                (s.kv_base_port + index, f"{name} KV", "--kv-base-port"),
            ]
        return wanted

    def port_clash(self) -> str | None:
        """Why two parts of the fleet would bind one port (its flags collide, e.g. a KV base
        port inside the vLLM ports' range), naming both flags; None when every port is its
        own."""
        first: dict[int, tuple[str, str]] = {}
        for port, what, flag in self.wanted_ports():
            if port in first:
                other, other_flag = first[port]
                flags = other_flag if other_flag == flag else f"{other_flag}, {flag}"
                return (
                    f"port {port} is given to both the {other} and the {what}; choose other "
                    f"ports ({flags})"
                )
            first[port] = (what, flag)
        return None

    def _routing(self) -> dict[str, Any]:
        """The served model's entry of the gateway's /health ({} when it does not answer)."""
        try:
            url = f"{self.gateway_url}/health"
            body = httpx.get(url, params={"model": self.model_name}, timeout=2.0).json()
        except (httpx.HTTPError, ValueError):
            return {}
        entry = body.get("models", {}).get(self.model_name) if isinstance(body, dict) else None
        return entry if isinstance(entry, dict) else {}

    def _wait_routing(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` until the gateway routes the served model precisely, and
        not at all once it says why it cannot (its instances publish no tokenizer, or
        different ones); sets `routing` and `routing_reason` from its last answer."""

        def settled() -> bool:
            entry = self._routing()
            if "routing" not in entry:
                return False  # the gateway has not looked at the model's tokenizer yet
            self.routing_reason = str(entry.get("routing_reason", ""))
            if entry["routing"] == "precise":
                self.routing = "precise"
            else:  # a tokenizer hash but routing by load: fetching (or retrying) it
                self.routing = "pending" if entry.get("tokenizer") else "load"
            return self.routing != "pending"

        # Past the wait, ready all the same: routing is by load until the tokenizer arrives.
        with contextlib.suppress(TimeoutError):
            wait_until(
                settled,
                timeout_s,
                watch=self._services,
                what="the gateway to route by the fleet's tokenizer",
                cancel=self._cancel,
            )

    def busy_ports(self) -> list[tuple[int, str]]:
        """(port, what) for every port the fleet would bind that is taken now on its host."""
        host = self.spec.host
        return [(port, what) for port, what, _ in self.wanted_ports() if port_taken(host, port)]

    def instance_ready(self, inst: Engine) -> bool:
        """True when `inst` answers /health and the engine answering is the one it started
        (a vLLM's KvTransfer health carries the server id that `inst`'s process was given;
        a sim's ports were free when it started)."""
        endpoint = inst.kv_endpoint if isinstance(inst, VllmCpuInstance) else None
        return inst.healthy() and (
            endpoint is None or grpc_serving(endpoint, server_id=inst.process.server_id)
        )

    def _wait(
        self,
        predicate: Callable[[], bool],
        deadline: float,
        watch: list[ManagedProcess],
        what: str,
    ) -> None:
        """Waits for `predicate` (see `wait_until`), saying every `_PROGRESS_EVERY_S` that it
        still waits: vLLM takes a minute or more to load, and a user should see it is alive."""
        started = said = time.monotonic()

        def progressing() -> bool:
            nonlocal said
            if time.monotonic() - said >= _PROGRESS_EVERY_S:
                said = time.monotonic()
                self._say(f"... waiting for {what} ({said - started:.0f} s)")
            return predicate()

        wait_until(
            progressing,
            max(1.0, deadline - time.monotonic()),
            watch=watch,
            what=what,
            cancel=self._cancel,
        )

    def _resolve_model(self) -> None:
        spec = self.spec
        if spec.engine == "sim":
            # Sims run no weights; with --model they tokenize with, and publish, its tokenizer.
            self.model_dir = spec.model
            self.model_name = spec.served_model_name or (
                spec.model.name if spec.model is not None else _TINY_MODEL_NAME
            )
            tokenizer = f"{spec.model}'s tokenizer" if spec.model is not None else "no tokenizer"
            self._say(f"engines: pdplane sim, profile {spec.sim_profile}, {tokenizer} (no model)")
            return
        if spec.model is not None:
            self.model_dir = spec.model
            self.model_name = spec.served_model_name or spec.model.name
            return
        from pdplane.models.tiny import build_tiny_model  # heavy (transformers): only when used

        self._say(f"tiny model: building or reusing it under {default_model_cache()}")
        self.model_dir = build_tiny_model(default_model_cache())
        self.model_name = spec.served_model_name or _TINY_MODEL_NAME
        self._say(f"model ready: {self.model_dir} (served as {self.model_name!r})")

    def _env(self, admin: bool = False, gateway: bool = False) -> dict[str, str]:
        """A child's environment: this one's plus the fleet's token (and, for the registry
        only, the admin token; for the gateway only, its API keys): `ps` shows argv to every
        user, the environment to none."""
        env = {**os.environ}
        secrets = (
            ("PDPLANE_TOKEN", self.spec.token),
            ("PDPLANE_ADMIN_TOKEN", self.spec.admin_token if admin else None),
            ("PDPLANE_API_KEY", self.spec.api_key if gateway else None),
        )
        for name, value in secrets:
            env.pop(name, None)
            if value:
                env[name] = value
        return env

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata carrying the fleet's token (empty for an open fleet)."""
        return grpc_util.token_metadata(self.spec.token)

    def _service(self, name: str, argv: list[str], admin: bool = False) -> ManagedProcess:
        proc = ManagedProcess(
            name,
            argv,
            self.spec.log_dir / f"{name}.log",
            env=self._env(admin, gateway=name == "gateway"),
            die_with_parent=self.die_with_parent,
        )
        self._services.append(proc)
        proc.start()
        self._say(f"{name} starting (log {proc.log_path})")
        return proc

    def _start_etcd(self, deadline: float) -> list[str]:
        """Starts the local etcd of `--store etcd`; returns the registry's extra flags."""
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("--store etcd needs etcd (Debian: apt-get install etcd-server)")
        port = self.spec.etcd_port
        data = self.spec.log_dir.resolve() / "etcd-data"
        shutil.rmtree(data, ignore_errors=True)  # a fresh cluster every run
        etcd = self._service("etcd", member_argv(binary, "pdplane", data, port, port + 1))
        where = f"127.0.0.1:{port}"
        self._answers[etcd] = (where, lambda: http_ok(f"http://{where}/health"))
        wait_until(
            self._answers[etcd][1],
            deadline - time.monotonic(),
            watch=[etcd],
            what=f"etcd at 127.0.0.1:{port}",
        )
        self._say(f"etcd healthy at 127.0.0.1:{port}")
        return ["--store", "etcd", "--etcd-endpoints", f"127.0.0.1:{port}"]

    def start_services(self, timeout_s: float) -> None:
        """Starts only registry, scheduler and gateway (etcd too with store "etcd") and waits
        until each answers; raises TimeoutError or ProcessDied like `start`."""
        self._start_services(time.monotonic() + timeout_s)

    def _start_services(self, deadline: float) -> None:
        s = self.spec
        store = self._start_etcd(deadline) if s.store == "etcd" else []
        reg = self._service(
            "registry",
            _pdplane("registry", "--host", s.host, "--port", str(s.registry_port), *store),
            admin=True,
        )
        self._answers[reg] = (
            self.registry_address,
            lambda: grpc_serving(self.registry_address, server_id=reg.server_id),
        )
        wait_until(
            self._answers[reg][1],
            deadline - time.monotonic(),
            watch=[reg],
            what=f"the registry at {self.registry_address}",
        )
        sch = self._service(
            "scheduler",
            _pdplane(
                "scheduler",
                "--registry",
                self.registry_address,
                "--host",
                s.host,
                "--port",
                str(s.scheduler_port),
                "--prefill-policy",
                s.prefill_policy,
                "--decode-policy",
                s.decode_policy,
                "--metrics-port",
                str(s.scheduler_metrics_port),
                *(["--kv-profile", s.kv_profile] if s.kv_profile else []),
                *s.scheduler_flags(),
            ),
        )
        self._answers[sch] = (
            self.scheduler_address,
            lambda: grpc_serving(self.scheduler_address, server_id=sch.server_id),
        )
        wait_until(
            self._answers[sch][1],
            deadline - time.monotonic(),
            watch=[sch],
            what=f"the scheduler at {self.scheduler_address}",
        )
        gw = self._service(
            "gateway",
            _pdplane(
                "gateway",
                "--scheduler",
                self.scheduler_address,
                "--registry",
                self.registry_address,
                "--host",
                s.host,
                "--port",
                str(s.gateway_port),
                *s.gateway_flags(),
                "--shutdown-timeout-s",
                str(s.gateway_shutdown_s),
            ),
        )
        # /health answers (503 until a pair registers) once the HTTP server is up.
        self._answers[gw] = (
            self.gateway_url,
            lambda: http_server_id(f"{self.gateway_url}/health") == gw.server_id,
        )
        wait_until(
            self._answers[gw][1],
            deadline - time.monotonic(),
            watch=[gw],
            what=f"the gateway at {self.gateway_url}",
        )
        self._say(f"registry, scheduler and gateway up ({self.gateway_url})")

    def _launch(self, role: KvRole, **overrides: Any) -> Engine:
        """Starts one more engine instance of `role` (returns at once; see wait_healthy), on
        the ports of the lowest index free (a removed instance's are reused; once the fleet
        runs, an index whose ports another process took is skipped)."""
        with self._lock:
            while True:
                if self._free_indices:
                    index = min(self._free_indices)
                    self._free_indices.remove(index)
                else:
                    index = self._next_index
                    self._next_index += 1
                # Ports beyond the initial fleet's were not checked at start: skip taken ones.
                ports = (self.spec.vllm_base_port + index, self.spec.kv_base_port + index)
                if not self.instances or not any(port_taken(self.spec.host, p) for p in ports):
                    break
        kind = "prefill" if role == "kv_producer" else "decode" if role == "kv_consumer" else "both"
        name = f"{kind}-{index}"
        log = self.spec.log_dir / f"{name}.log"
        inst: Engine
        if self.spec.engine == "sim":
            inst = SimProcess(
                SimOptions(
                    role=role,
                    port=self.spec.vllm_base_port + index,
                    kv_port=self.spec.kv_base_port + index,
                    registry=self.registry_address,
                    instance_id=name,
                    model=self.model_name,
                    host=self.spec.host,
                    profile=self.spec.sim_profile,
                    token=self.spec.token,
                    tokenizer=self.model_dir,
                    max_model_len=self.spec.sim_max_model_len,
                    extra_args=list(self.spec.vllm_args),
                ),
                log,
            )
        else:
            assert self.model_dir is not None, "start() resolves the model first"
            options = VllmCpuOptions(
                model=self.model_dir,
                port=self.spec.vllm_base_port + index,
                host=self.spec.host,
                role=role,
                served_model_name=self.model_name,
                kv_port=self.spec.kv_base_port + index,
                registry=self.registry_address,
                instance_id=name,
                # Spread instances over the cores so that two engines don't fight for one.
                omp_threads_bind=str(index % self._cores),
                max_model_len=self.spec.max_model_len,
                extra_args=list(self.spec.vllm_args),
                token=self.spec.token,
                registry_token=self.spec.token,
                **{**self.spec.vllm_options, **overrides},
            )
            inst = VllmCpuInstance(options, log)
        inst.process.die_with_parent = self.die_with_parent
        inst.start()
        self.instances.append(inst)
        self._names[inst] = name
        self._indices[inst] = index
        self._say(f"{name} starting: engine on {inst.url}, KV on {inst.kv_endpoint}")
        return inst

    def launch_instance(self, role: KvRole) -> Engine:
        """Scales out while serving without waiting: starts one instance and returns it;
        `instance_ready` tells when it serves."""
        return self._launch(role)

    def name_of(self, inst: Engine) -> str:
        """The instance's name, which is also its registry id (e.g. decode-3)."""
        return self._names[inst]

    def remove_instance(self, inst: Engine) -> None:
        """Stops `inst` (SIGTERM: it deregisters) and forgets it; its index and ports are
        reused by the next instance started."""
        inst.stop()
        with self._lock:
            if inst in self.instances:
                self.instances.remove(inst)
            self._names.pop(inst, None)
            self._reported_dead.discard(inst)
            self._restarting.discard(inst)
            index = self._indices.pop(inst, None)
            if index is not None:
                self._free_indices.append(index)

    def add_instance(self, role: KvRole, timeout_s: float = 300.0, **overrides: Any) -> Engine:
        """Scales out while serving: starts one instance and waits until it is registered."""
        inst = self._launch(role, **overrides)
        self._wait(
            inst.healthy,
            time.monotonic() + timeout_s,
            [inst.process],
            f"{self._names[inst]} to be healthy",
        )
        self.wait_registered(len(self.instances), timeout_s)
        return inst

    def restart_instance(self, inst: Engine) -> None:
        """Starts a dead instance again with its ports, id and flags (returns at once): what
        is left of its process group is ended first, so its ports are free. The instance
        registers again by itself; `newly_healthy_instances` reports when it serves."""
        inst.stop()
        inst.start()
        self._reported_dead.discard(inst)
        self._restarting.add(inst)

    def newly_healthy_instances(self) -> list[tuple[str, Engine]]:
        """Restarted instances that serve again since the last call, with their names."""
        back = [(self._names[i], i) for i in list(self._restarting) if self.instance_ready(i)]
        self._restarting.difference_update(inst for _, inst in back)
        return back

    def list_instances(self) -> list[instance_pb2.Instance]:
        """The registry's current list (raises grpc.RpcError when it is unreachable)."""
        with grpc.insecure_channel(self.registry_address) as channel:
            stub = registry_pb2_grpc.RegistryStub(channel)
            reply = stub.ListInstances(
                registry_pb2.ListInstancesRequest(), timeout=5.0, metadata=self.metadata
            )
        return list(reply.instances)

    def wait_registered(self, count: int, timeout_s: float) -> None:
        """Waits until the registry lists at least `count` instances."""

        def enough() -> bool:
            try:
                return len(self.list_instances()) >= count
            except grpc.RpcError:
                return False

        wait_until(enough, timeout_s, watch=self._services, what=f"{count} instances to register")

    def service_pids(self) -> list[int]:
        """Process ids of the running registry, scheduler and gateway (etcd too)."""
        return [p.pid for p in self._services if p.pid is not None and p.returncode is None]

    def dead_service(self) -> ManagedProcess | None:
        """The first of registry, scheduler and gateway that has exited, if any."""
        return next((p for p in self._services if p.returncode is not None), None)

    def restart_service(self, proc: ManagedProcess) -> None:
        """Starts a dead registry, scheduler or gateway (or etcd) again with its ports and
        flags (returns at once); `services_back` reports when it answers again."""
        proc.start()
        self._restarting_services.add(proc)

    def services_back(self) -> list[tuple[str, str]]:
        """(name, address) of the restarted services that answer again, each once: the
        answer comes from the process started last (its server id), not an earlier one."""
        back = [
            p
            for p in list(self._restarting_services)
            if p.returncode is None and self._answers[p][1]()
        ]
        self._restarting_services.difference_update(back)
        return [(p.name, self._answers[p][0]) for p in back]

    def newly_dead_instances(self) -> list[tuple[str, Engine]]:
        """vLLM instances that exited since the last call, with their names (each once)."""
        dead = [
            (name, inst)
            for inst, name in self._names.items()
            if inst.process.returncode is not None and inst not in self._reported_dead
        ]
        self._reported_dead.update(inst for _, inst in dead)
        return dead

    def stop(self) -> None:
        """Stops the gateway first: it takes no new request and lets open ones finish on the
        engines for `gateway_shutdown_s` (then ends them with an error event saying it shuts
        down); then the engines (they deregister), then scheduler, registry (and etcd).
        Bounded: about `gateway_shutdown_s` plus each child's grace."""
        gateways = [p for p in self._services if p.name == "gateway"]
        for proc in gateways:
            proc.stop(grace_s=self.spec.gateway_shutdown_s + 5.0)
        # The engines stop side by side: each vLLM takes seconds to shut down, and one after
        # another they made a 1P2D fleet's stop take tens of seconds.
        stoppers = [
            threading.Thread(target=inst.stop, name=f"stop-{i}", daemon=True)
            for i, inst in enumerate(self.instances)
        ]
        for thread in stoppers:
            thread.start()
        for thread in stoppers:
            thread.join()
        for proc in reversed(self._services):
            if proc not in gateways:
                proc.stop()

    # -- demo -------------------------------------------------------------------------------
    def demo_request(
        self, prompt: str = "Say hello to the prefill and decode instances.", max_tokens: int = 24
    ) -> str:
        """One non-streaming chat completion through the gateway, with the key of
        `FleetSpec.client_key` when it requires one; returns the text.

        Raises DemoRequestFailed with the gateway's status and error message (or why no answer
        came), ValueError when the tenants file cannot be read.
        """
        body = {
            "model": self.model_name,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        key = self.spec.client_key()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        url = f"{self.gateway_url}/v1/chat/completions"
        try:
            reply = httpx.post(url, json=body, headers=headers, timeout=120.0)
        except httpx.HTTPError as exc:
            raise DemoRequestFailed(f"{url}: {type(exc).__name__}: {exc}") from None
        if reply.status_code != 200:
            raise DemoRequestFailed(f"HTTP {reply.status_code}: {_error_message(reply)}")
        try:
            return str(reply.json()["choices"][0]["message"]["content"])
        except (ValueError, LookupError, TypeError):
            raise DemoRequestFailed(f"unexpected answer: {reply.text[:200]!r}") from None


def _error_message(reply: httpx.Response) -> str:
    """The OpenAI error body's message, else the start of the body."""
    try:
        return str(reply.json()["error"]["message"])
    except (ValueError, LookupError, TypeError):
        return reply.text[:200] or reply.reason_phrase
