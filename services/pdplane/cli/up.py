"""`pdplane up`: the embedded default on one machine, no GPU, no Docker.

Builds (once, cached) a tiny Llama model unless `--model` names one, then starts the registry,
the scheduler, the gateway and an XpYd fleet of vLLM CPU instances with the pdplane connector
(1P1D by default), waits until the gateway reports a usable pair, prints where everything is,
optionally sends one OpenAI request (`--demo`), and serves until Ctrl-C / SIGTERM, when it stops
every child (process groups, bounded) so that nothing is left behind; the children also get
SIGTERM if `pdplane up` itself is killed.

The fleet is token-protected with nothing to type: `pdplane up` generates a shared token and
an admin token for each run, gives them to its children through their environment and writes
them (0600) to the fleet's own file and `pdplane.cli.fleet_credentials.credentials_path()`,
where `pdplane ls`, `pdplane drain` and `pdplane vllm` find them when they talk to this
registry (another fleet on other ports keeps its own).

It refuses to start (status 2, naming them) when any port it needs is taken, e.g. by another
`pdplane up`, and it reports a process "up" or "healthy" only once the answer comes from the
process it started (each child's health carries its own server id).

Any child that exits while serving is restarted on its ports: a registry, scheduler or gateway
(instances re-register and watchers re-watch by themselves; "serving again" is logged once it
answers) and a vLLM instance alike (same
id and flags; what its process group left behind is ended first, so its ports are free; while
it is down the gateway's /health already says so, since its connector deregisters as its API
server goes). `pdplane up` gives up with status 1 only when one child crashes more than three
times in a minute.
"""

from __future__ import annotations

import copy
import dataclasses
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, Literal
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import start_http_server
from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator

from pdplane.autoscale.local import LocalActuator
from pdplane.autoscale.loop import Autoscaler
from pdplane.autoscale.scrape import FleetScraper
from pdplane.autoscale.settings import AutoscaleOptions
from pdplane.cli import fleet_credentials
from pdplane.core import defaults
from pdplane.gateway.settings import GatewaySettings
from pdplane.gateway.tenants import load_tenants
from pdplane.launch.deployment import DemoRequestFailed, Fleet, FleetSpec, PortsInUse
from pdplane.launch.process import Cancelled
from pdplane.scheduler.settings import PolicySettings
from pdplane.sim.profiles import load_profile

__all__ = ["UpSettings", "main"]


def _gateway_flag(name: str) -> Any:
    """The gateway's field `name` as a flag of `pdplane up` (same default, bounds and help,
    marked "gateway:"), which passes it on to its gateway."""
    field = copy.copy(GatewaySettings.model_fields[name])
    field.description = f"gateway: {field.description}"
    return field


def _scheduler_flag(name: str) -> Any:
    """The scheduler's field `name` as a flag of `pdplane up` (same default, bounds and help,
    marked "scheduler:"), which passes it on to its scheduler."""
    field = copy.copy(PolicySettings.model_fields[name])
    field.description = f"scheduler: {field.description}"
    return field


class UpSettings(AutoscaleOptions):
    """Start registry, scheduler, gateway and a vLLM CPU XpYd fleet on this machine."""

    prefill: int = Field(1, ge=1, le=16, description="prefill (kv_producer) vLLM instances")
    decode: int = Field(1, ge=1, le=16, description="decode (kv_consumer) vLLM instances")
    host: str = Field("127.0.0.1", description="address every service listens on")
    gateway_port: int = Field(defaults.GATEWAY_PORT, ge=1, le=65535, description="gateway HTTP")
    registry_port: int = Field(defaults.REGISTRY_PORT, ge=1, le=65535, description="registry gRPC")
    scheduler_port: int = Field(
        defaults.SCHEDULER_PORT, ge=1, le=65535, description="scheduler gRPC"
    )
    scheduler_metrics_port: int = Field(
        defaults.SCHEDULER_METRICS_PORT,
        ge=1,
        le=65535,
        description="scheduler Prometheus /metrics HTTP (decisions, predicted prefix cache hits)",
    )
    vllm_base_port: int = Field(
        defaults.VLLM_BASE_PORT, ge=1, le=65000, description="first vLLM HTTP port"
    )
    kv_base_port: int = Field(
        defaults.KV_BASE_PORT, ge=1, le=65000, description="first connector KvTransfer port"
    )
    model: Path | None = Field(
        None,
        description="model directory to serve (default: a tiny Llama built locally; with "
        "--engine sim none); sims use only its tokenizer, and publish it for precise routing",
    )
    served_model_name: str | None = Field(
        None, description="model name clients use (default: 'tiny-llama' or the folder name)"
    )
    vllm_args: str = Field("", description="extra arguments for every vLLM instance (one string)")
    max_model_len: int = Field(
        1024,
        ge=16,
        le=8192,
        description="tokens per request, prompt + output, of every vLLM instance (vLLM's "
        "--max-model-len; the KV cache of 64 blocks x 128 tokens holds 8192); with --engine "
        "sim, given: the sims' (else their profile's)",
    )
    kv_mode: Literal["pull", "push"] = Field(
        "pull", description="KV hand-off: decode pulls (default) or prefill pushes layer by layer"
    )
    prefill_policy: str = Field("kv_aware", description="scheduler prefill policy")
    decode_policy: str = Field("kv_aware", description="scheduler decode policy")
    kv_profile: str = Field(
        "tiny-cpu",
        description="engine profile kv_aware predicts latencies with: a built-in name or a "
        "`pdplane profile` JSON (tiny-cpu: the tiny model on vLLM CPU, what up serves without "
        "--model)",
    )
    kv_warm_min_tokens: int = _scheduler_flag("kv_warm_min_tokens")
    kv_warm_window_s: float = _scheduler_flag("kv_warm_window_s")
    kv_warm_requests_per_holder: int = _scheduler_flag("kv_warm_requests_per_holder")
    queue_timeout_s: float = Field(
        60.0,
        ge=0,
        description="gateway: a request finding the fleet full (no decode KV room), or no "
        "decode serving for a moment (one restarting), waits this long, as vLLM queues it, "
        "then gets 503; 0 = 503 at once (s)",
    )
    tenants: Path | None = Field(
        None,
        description="gateway: tenants file (API keys, tenants, priorities, rate limits; "
        "reread when it changes; see docs/flow-control.md); --demo sends its first key",
    )
    api_key: str | None = _gateway_flag("api_key")
    inflight_budget: float = _gateway_flag("inflight_budget")
    flow_policy: Literal["fair", "fifo"] = _gateway_flag("flow_policy")
    max_queued_requests: int = _gateway_flag("max_queued_requests")
    migration_limit: int = _gateway_flag("migration_limit")
    migration_timeout_s: float = _gateway_flag("migration_timeout_s")
    drain_grace_s: float = _gateway_flag("drain_grace_s")
    log_dir: Path = Field(Path("logs"), description="folder for every process's log")
    ready_timeout_s: float = Field(600.0, gt=0, description="give up starting after (s)")
    demo: bool = Field(False, description="send one chat request once ready and print it")
    exit_after_demo: bool = Field(False, description="with --demo: stop everything afterwards")
    store: Literal["memory", "etcd"] = Field(
        "memory", description="registry store; etcd also starts a local etcd (etcd-server)"
    )
    etcd_port: int = Field(2379, ge=1, le=65534, description="with --store etcd: client port")
    engine: Literal["vllm", "sim"] = Field(
        "vllm", description="instances: vLLM CPU, or `pdplane sim` (no model, starts in seconds)"
    )
    sim_profile: str = Field(
        "tiny-cpu", description="with --engine sim: the sims' engine profile (name or JSON file)"
    )
    autoscale: bool = Field(
        False,
        description="resize the fleet while serving: the controller (docs/autoscale.md) starts "
        "and drains instances within --min/--max-prefill, --min/--max-decode and --gpus",
    )
    autoscale_metrics_port: int = Field(
        defaults.AUTOSCALE_METRICS_PORT,
        ge=0,
        le=65535,
        description="with --autoscale: the controller's Prometheus /metrics HTTP (wanted and "
        "running instances, moves, predicted before/after; 0 = off)",
    )

    @model_validator(mode="before")
    @classmethod
    def _controller_only_with_autoscale(cls, data: Any) -> Any:
        # The controller's PDPLANE_* variables are read only with --autoscale (docs/autoscale.md):
        # without it a PDPLANE_GPUS meant for `pdplane plan` must not stop the fleet from
        # starting. Its flags given without --autoscale are refused by `parse` (argv).
        if not isinstance(data, dict):
            return data
        try:
            on = TypeAdapter(bool).validate_python(data.get("autoscale", False))
        except ValidationError:
            return data  # the field's own check reports it
        if on:
            return data
        return {k: v for k, v in data.items() if k not in AutoscaleOptions.model_fields}

    @field_validator("kv_profile")
    @classmethod
    def _known_profile(cls, name: str) -> str:
        load_profile(name)  # ValueError names the known profiles or what is wrong with the file
        return name

    @field_validator("sim_profile")
    @classmethod
    def _known_sim_profile(cls, name: str) -> str:
        load_profile(name)  # ValueError names the known profiles or what is wrong with the file
        return name

    @field_validator("tenants")
    @classmethod
    def _valid_tenants(cls, path: Path | None) -> Path | None:
        if path is not None:
            load_tenants(path)  # ValueError names the file and what is wrong with it
        return path


class _Stop:
    """Set by SIGINT/SIGTERM; the main thread waits on it."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal: int | None = None

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        self.signal = signum
        self.event.set()


class _RestartBudget:
    """At most `per_minute` restarts of one service in any 60 s window (a crash loop stops)."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._times: dict[str, list[float]] = {}

    def allow(self, name: str) -> bool:
        now = time.monotonic()
        recent = [t for t in self._times.get(name, []) if now - t < 60.0]
        self._times[name] = [*recent, now]
        return len(recent) < self.per_minute


def _say(message: str) -> None:
    sys.stdout.write(f"[pdplane up] {message}\n")
    sys.stdout.flush()


def _restart_instances(fleet: Fleet, restarts: _RestartBudget) -> bool:
    """Restarts the vLLM instances that died. One that keeps failing (past its restart budget)
    is left stopped and forgotten, as its tail says why, while the rest of the fleet serves:
    one instance killed again and again (the OOM killer, a bad device) must not take the
    others down. False (give up) when that leaves its role with no instance."""
    for name, inst in fleet.newly_dead_instances():
        if restarts.allow(name):
            _say(f"{name} exited with status {inst.process.returncode}; restarting it")
            fleet.restart_instance(inst)
            continue
        role, kind = inst.options.role, name.rsplit("-", 1)[0]  # decode-1 -> decode
        fleet.remove_instance(inst)
        left = [i for i in fleet.instances if i.options.role == role]
        if not left:
            _say(f"{name} keeps failing; giving up (no {kind} left):\n{inst.process.tail()}")
            return False
        _say(
            f"{name} keeps failing ({restarts.per_minute} restarts within a minute); left "
            f"stopped, {len(left)} {kind} instance(s) serve on:\n{inst.process.tail()}"
        )
    for name, inst in fleet.newly_healthy_instances():
        _say(f"{name} healthy again at {inst.url}")
    return True


def _controller_profile(settings: UpSettings) -> str:
    """The engine profile the controller simulates with unless --autoscale-profile says."""
    return settings.sim_profile if settings.engine == "sim" else "tiny-cpu"


def _autoscaler(settings: UpSettings, fleet: Fleet) -> Autoscaler:
    """The controller acting on `fleet` through the local actuator (`--autoscale`)."""
    profile = _controller_profile(settings)
    scraper = FleetScraper(
        fleet.registry_address,
        window_s=settings.autoscale_window_s,
        model=fleet.model_name,
        token=fleet.spec.token,
        gateway=fleet.gateway_url,
    )
    actuator = LocalActuator(fleet, say=_say, drain_timeout_s=settings.drain_timeout_s)
    return Autoscaler(settings.controller(profile), scraper, actuator, say=_say)


def _autoscale_step(autoscaler: Autoscaler) -> None:
    """One control step; a registry or gateway that does not answer skips it (said once)."""
    try:
        autoscaler.step()
    except grpc.RpcError as exc:
        code = exc.code().name if isinstance(exc, grpc.Call) else "ERROR"
        _say(f"autoscale: registry {code}; step skipped")


def _supervise(
    fleet: Fleet, stop: threading.Event, autoscaler: Autoscaler | None = None, every_s: float = 5.0
) -> int:
    """Serves until `stop` is set (returns 0) or a child crash-loops (returns 1); with an
    `autoscaler`, runs a control step every `every_s` seconds."""
    restarts = _RestartBudget(per_minute=3)
    last_step = time.monotonic()
    while not stop.wait(1.0):
        if autoscaler is not None and time.monotonic() - last_step >= every_s:
            last_step = time.monotonic()
            _autoscale_step(autoscaler)
        if not _restart_instances(fleet, restarts):
            return 1
        failed = fleet.dead_service()
        if failed is not None:
            _say(f"{failed.name} exited with status {failed.returncode}; restarting it")
            if not restarts.allow(failed.name):
                _say(f"{failed.name} keeps failing; giving up:\n{failed.tail()}")
                return 1
            # The instances re-register and the scheduler/gateway re-watch by themselves.
            fleet.restart_service(failed)
        for name, address in fleet.services_back():
            _say(f"{name} serving again at {address}")
    return 0


def controller_flags_without_autoscale(argv: list[str], settings: UpSettings) -> list[str]:
    """The controller's flags (`AutoscaleOptions`) given in `argv` although `--autoscale` is
    off: they would be accepted and do nothing, so `main` refuses them."""
    if settings.autoscale:
        return []
    given = []
    for name in [*AutoscaleOptions.model_fields, "autoscale_metrics_port"]:
        flags = {f"--{name.replace('_', '-')}", f"--{name}"}
        if any(arg.split("=", 1)[0] in flags for arg in argv):
            given.append(f"--{name.replace('_', '-')}")
    return given


def autoscale_problem(settings: UpSettings) -> str | None:
    """What keeps `--autoscale` from starting with these settings (a bad SLO or profile, a
    starting fleet outside the controller's bounds), checked before anything starts; None
    when nothing."""
    if not settings.autoscale:
        return None
    try:
        settings.controller(_controller_profile(settings))
    except ValueError as exc:
        return str(exc)
    for role, have, least, most in (
        ("prefill", settings.prefill, settings.min_prefill, settings.max_prefill),
        ("decode", settings.decode, settings.min_decode, settings.max_decode),
    ):
        if not least <= have <= most:
            return f"--{role} {have} is outside --min-{role} {least} .. --max-{role} {most}"
    held = (settings.prefill + settings.decode) * settings.gpus_per_instance
    if settings.gpus and held > settings.gpus:
        return f"--prefill + --decode hold {held} GPUs, more than --gpus {settings.gpus}"
    return None


def parse(argv: list[str]) -> UpSettings:
    """`pdplane up`'s settings from `argv` and `PDPLANE_*`; exits with status 2 and a message on
    bad flags, including a controller flag without --autoscale and a starting fleet the
    controller could not act on (`autoscale_problem`)."""
    settings = UpSettings.parse(argv)
    idle = controller_flags_without_autoscale(argv, settings)
    if idle:
        sys.stderr.write(
            f"error: pdplane up: {', '.join(idle)}: the autoscaling controller's, which runs "
            "only with --autoscale (add it, or leave them out)\n"
        )
        raise SystemExit(2)
    problem = autoscale_problem(settings)
    if problem:
        sys.stderr.write(f"error: pdplane up: --autoscale: {problem}\n")
        raise SystemExit(2)
    return settings


def main(argv: list[str]) -> int:
    """Runs `pdplane up`; returns 0 after a clean Ctrl-C/SIGTERM, 2 when a port it needs is
    taken (nothing started), 1 if a child failed; exits 2 on bad flags (`parse`)."""
    settings = parse(argv)
    stop = _Stop()
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)

    # Secure by default with nothing to type: fresh tokens for every run, handed to the
    # children through their environment and to local tools (`pdplane ls`, `drain`, `vllm`)
    # through a 0600 file.
    creds = fleet_credentials.generate(f"{settings.host}:{settings.registry_port}")
    spec = FleetSpec.from_settings(settings, token=creds.token, admin_token=creds.admin_token)
    fleet = Fleet(spec, say=_say)
    fleet.die_with_parent = True
    # Local tools (`pdplane grpc`) send the shared token to the scheduler and KV servers too.
    creds = dataclasses.replace(
        creds, services=fleet.service_addresses(), scheduler=fleet.scheduler_address
    )
    status = 0
    metrics_server: WSGIServer | None = None
    try:
        # Not over another running fleet's file: start() reports its ports taken instead.
        path = fleet_credentials.credentials_path()
        if not fleet.busy_ports():
            fleet_credentials.write(creds, path)
        fleet.start(cancel=stop.event)
        _say(f"ready in {fleet.ready_after_s:.0f} s")
        _say(f"  gateway (OpenAI API): {fleet.gateway_url}/v1   model: {fleet.model_name}")
        ls = "pdplane ls"
        if fleet.registry_address != f"127.0.0.1:{defaults.REGISTRY_PORT}":
            ls += f" --registry {fleet.registry_address}"
        _say(f"  registry (gRPC):      {fleet.registry_address}   try: {ls}")
        _say(f"  scheduler (gRPC):     {fleet.scheduler_address}")
        _say(f"  scheduler metrics:    {fleet.scheduler_metrics_url}")
        if fleet.routing == "precise":
            _say(f"  routing:              precise (KV-aware): {fleet.routing_reason}")
        elif fleet.routing == "pending":  # still, after a bounded wait
            _say(
                "  routing:              by load until the gateway has the model's tokenizer "
                f"({fleet.routing_reason}; /health says when)"
            )
        else:
            _say(f"  routing:              by load: {fleet.routing_reason}")
            if settings.engine == "sim" and settings.model is None:
                _say(f"  {'':<22}(sims publish a tokenizer with --model DIR: its tokenizer)")
        _say(f"  logs:                 {spec.log_dir.resolve()}")
        _say(
            f"  tokens:               {path} and {fleet_credentials.fleet_path(creds)} "
            "(read by pdplane ls, drain, vllm, grpc, plan --registry)"
        )
        if settings.demo:
            _say("demo request: POST /v1/chat/completions")
            try:
                _say(f"  answer: {fleet.demo_request()!r}")
            except (DemoRequestFailed, ValueError) as exc:
                # The fleet stays up (a tenants file can be fixed while it serves).
                _say(f"demo request failed: {exc}")
                if settings.exit_after_demo:
                    return 1
            if settings.exit_after_demo:
                return 0
        autoscaler = None
        if settings.autoscale:
            autoscaler = _autoscaler(settings, fleet)
            b = settings.bounds()
            _say(
                f"autoscale: every {settings.autoscale_interval_s:g} s, prefill "
                f"{b.min_prefill}..{b.max_prefill}, decode {b.min_decode}..{b.max_decode}, "
                f"at most {b.max_instances * b.gpus_per_instance} GPUs"
                + (
                    f", mean {settings.mean_gpus:g} GPUs over {settings.spend_window_s:g} s"
                    if settings.mean_gpus
                    else ""
                )
                + f", SLO {settings.slo}, profile "
                + (settings.autoscale_profile or _controller_profile(settings))
            )
            if fleet.spec.autoscale_metrics_port:
                metrics_server, _ = start_http_server(
                    fleet.spec.autoscale_metrics_port,
                    addr=settings.host,
                    registry=autoscaler.metrics.registry,
                )
                _say(f"  autoscale metrics:    {fleet.autoscale_metrics_url}")
        _say("serving; Ctrl-C stops everything")
        status = _supervise(fleet, stop.event, autoscaler, settings.autoscale_interval_s)
    except Cancelled:
        _say("interrupted during start-up")
    except PortsInUse as exc:  # bad input, as for a bad flag: nothing was started
        _say(f"error: {exc}")
        status = 2
    except (TimeoutError, RuntimeError, OSError) as exc:
        _say(f"error: {exc}")
        status = 1
    finally:
        _say("stopping")
        started = time.monotonic()
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
        fleet.stop()
        fleet_credentials.remove(creds)
        _say(f"stopped in {time.monotonic() - started:.1f} s")
    return status
