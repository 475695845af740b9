"""`pdplane vllm`: one vLLM CPU instance with the pdplane connector, registered with a registry.

The way to add an instance to a running system: it builds the same lean vLLM command line as
`pdplane up` (`pdplane.launch.vllm_cpu`: identical flags on every instance, so KV layouts match)
and runs the vLLM server as its supervised child (`pdplane.launch.foreground`): Ctrl-C / SIGTERM
go to the API server alone, which stops its engine cleanly; no process of the instance outlives
the one above it (a SIGKILLed `pdplane vllm` or API server takes the rest along); the exit
status is the server's. It says `ready` once the server answers `/health`, and removes the
private folder of the server's KV events socket when the server has exited, whatever ended it.

    pdplane vllm --role decode --port 8102 --kv-port 8202      # joins 127.0.0.1:8051

The docker image's `pdplane-vllm-cpu` entry is this command with container defaults.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import grpc
from pydantic import Field

from pdplane.cli import fleet_credentials
from pdplane.core import defaults
from pdplane.core.grpc import util as grpc_util
from pdplane.core.listen import refuse_taken
from pdplane.core.settings import CommandSettings
from pdplane.core.token_file import token_file_field
from pdplane.launch.foreground import run_in_foreground
from pdplane.launch.process import http_ok
from pdplane.launch.vllm_cpu import VllmCpuInstance, VllmCpuOptions
from pdplane.v1 import registry_pb2, registry_pb2_grpc

__all__ = ["InstanceSettings", "build", "main"]

_KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
_ANY_ADDRESS = ("0.0.0.0", "::")
#: Longest wait, once the server answers, for the registry to list it before `ready` (s).
_REGISTERED_WITHIN_S = 30.0


class InstanceSettings(CommandSettings):
    """Start one vLLM CPU instance with the pdplane connector and register it."""

    role: Literal["prefill", "decode", "both"] = Field(description="prefill, decode or both")
    registry: str = Field(
        f"127.0.0.1:{defaults.REGISTRY_PORT}", description="registry gRPC address host:port"
    )
    model: Path | None = Field(
        None, description="model directory to serve (default: the tiny model of `pdplane up`)"
    )
    served_model_name: str = Field("tiny-llama", description="model name clients use")
    kv_mode: Literal["pull", "push"] = Field(
        "pull", description="KV hand-off; use the same as the rest of the fleet"
    )
    instance_id: str | None = Field(
        None, description="registry id (default: <hostname>-<kv port>-<random>)"
    )
    host: str = Field("127.0.0.1", description="address the HTTP and KvTransfer servers bind")
    port: int = Field(defaults.VLLM_BASE_PORT, ge=1, le=65535, description="OpenAI HTTP port")
    kv_port: int = Field(defaults.KV_BASE_PORT, ge=1, le=65535, description="KvTransfer port")
    advertise_host: str | None = Field(
        None, description="host peers and the gateway reach this instance by (default: --host)"
    )
    token: str | None = Field(
        None, description="bearer token required on KvTransfer calls and sent to the registry"
    )
    registry_token: str | None = Field(
        None, description="bearer token for the registry when it differs from --token"
    )
    token_file: str | None = token_file_field("--token")
    registry_token_file: str | None = token_file_field("--registry-token")
    tls_ca: str | None = Field(
        None, description="PEM CA to verify the registry's and the peers' KvTransfer TLS"
    )
    tls_cert: str | None = Field(None, description="PEM certificate: serve KvTransfer over TLS")
    tls_key: str | None = Field(None, description="PEM private key for --tls-cert")
    omp_threads_bind: str | None = Field(
        None, description="VLLM_CPU_OMP_THREADS_BIND, e.g. '0' to pin to core 0"
    )
    max_model_len: int = Field(
        1024,
        ge=16,
        description="tokens per request, prompt + output (vLLM's --max-model-len; use the "
        "fleet's value: the registry pairs only instances with equal lengths)",
    )
    vllm_args: str = Field("", description="extra vLLM flags (one string, split on spaces)")


def _model_dir(settings: InstanceSettings) -> Path:
    if settings.model is not None:
        return settings.model
    from pdplane.launch.deployment import default_model_cache
    from pdplane.models.tiny import build_tiny_model  # transformers: only when needed

    return build_tiny_model(default_model_cache())


def _instance(settings: InstanceSettings) -> VllmCpuInstance:
    """The instance `settings` describe (not started; its KV events folder exists: call
    `remove_events_dir()` once done with it)."""
    host = settings.advertise_host or settings.host
    if host in _ANY_ADDRESS:
        raise SystemExit("error: --advertise-host is required when --host binds every address")
    extra: dict[str, object] = {"url": f"http://{host}:{settings.port}", "advertise_host": host}
    if settings.kv_mode != "pull":
        extra["mode"] = settings.kv_mode
    if settings.tls_ca:
        extra.update(registry_tls_ca=settings.tls_ca, tls_ca=settings.tls_ca)
    if settings.tls_cert or settings.tls_key:
        extra.update(tls_cert=settings.tls_cert, tls_key=settings.tls_key)
    # Joining the local `pdplane up` fleet needs nothing typed: its token is in its file.
    token = fleet_credentials.token_for(settings.registry or "", settings.token)
    options = VllmCpuOptions(
        model=_model_dir(settings),
        port=settings.port,
        host=settings.host,
        role=_KV_ROLES[settings.role],  # type: ignore[arg-type]
        served_model_name=settings.served_model_name,
        kv_port=settings.kv_port,
        instance_id=settings.instance_id,
        registry=settings.registry,
        registry_token=settings.registry_token or token,
        token=token,
        connector_extra=extra,
        omp_threads_bind=settings.omp_threads_bind,
        max_model_len=settings.max_model_len,
        extra_args=settings.vllm_args.split(),
    )
    return VllmCpuInstance(options, log_path=Path(os.devnull))


def build(settings: InstanceSettings) -> tuple[list[str], dict[str, str]]:
    """The vLLM server's argv and environment for `settings` (nothing is started or left
    behind: the KV events folder the argv names is made by whoever starts it)."""
    instance = _instance(settings)
    try:
        return instance.command(), instance.env()
    finally:
        instance.remove_events_dir()


@dataclass(frozen=True)
class _RegistryView:
    """Where `pdplane vllm` looks for its instance once it serves (gRPC host:port, token,
    PEM CA)."""

    address: str
    token: str | None
    tls_ca: str | None


def _listed(registry: _RegistryView, url: str) -> bool:
    """True when the registry lists an instance serving `url` (False while it is unreachable
    or refuses: the ready line then waits for the bound in `_say_when_ready`)."""
    metadata = grpc_util.token_metadata(registry.token)
    try:
        with grpc_util.channel(registry.address, registry.tls_ca) as channel:
            stub = registry_pb2_grpc.RegistryStub(channel)
            reply = stub.ListInstances(
                registry_pb2.ListInstancesRequest(), timeout=5.0, metadata=metadata
            )
    except grpc.RpcError:
        return False
    return any(i.spec.url == url for i in reply.instances)


def _say_when_ready(
    url: str,
    advertised: str,
    what: str,
    started: float,
    done: threading.Event,
    registry: _RegistryView,
) -> None:
    """Writes one `ready` line once `url`/health answers 200 and the registry lists an
    instance at the `advertised` URL (each polled every 0.5 s; the connector registers only
    once the server answers), unless `done` is set first (the server exited). Past
    `_REGISTERED_WITHIN_S` after the health check the line says the registry does not list it
    yet."""
    while not done.wait(0.5):
        if http_ok(f"{url}/health"):
            break
    else:
        return
    serving = time.monotonic()
    while not _listed(registry, advertised):
        if done.wait(0.5):
            return
        if time.monotonic() - serving > _REGISTERED_WITHIN_S:
            what += f" (serving, but not yet listed by the registry at {registry.address})"
            break
    took = time.monotonic() - started
    sys.stderr.write(f"pdplane vllm: ready in {took:.0f} s: {what}\n")
    sys.stderr.flush()


def main(argv: list[str], settings_cls: type[InstanceSettings] = InstanceSettings) -> int:
    """Parses the settings, runs vLLM until it exits and returns its exit status; 2 at once,
    with one line naming the address and the flag, when `--port` or `--kv-port` is taken
    (before the model is built or vLLM starts: vLLM would fail on it only after loading,
    tens of seconds later, with tracebacks)."""
    settings = settings_cls.parse(argv, prog="pdplane vllm")
    wanted = [(settings.port, "--port"), (settings.kv_port, "--kv-port")]
    if refuse_taken("pdplane vllm", settings.host, wanted):
        return 2
    started = time.monotonic()
    instance = _instance(settings)
    done = threading.Event()
    try:
        command = instance.command()
        serve = command[2:4] == ["pdplane.cli.vllm_console", "serve"]
        launcher = "vllm serve" if serve else command[2]
        where = f"HTTP {settings.host}:{settings.port}, KvTransfer :{settings.kv_port}"
        sys.stderr.write(f"pdplane vllm: starting {launcher} ({settings.role}; {where})\n")
        sys.stderr.flush()
        # Polled on the loopback when the server binds every address.
        local = f"http://127.0.0.1:{settings.port}" if settings.host in _ANY_ADDRESS else None
        advertised = str(instance.options.connector_extra["url"])
        shown = f"{advertised}/v1"
        o = instance.options
        registry = _RegistryView(o.registry or settings.registry, o.registry_token, settings.tls_ca)
        what = f"{shown} ({settings.role}, model {settings.served_model_name})"
        threading.Thread(
            target=_say_when_ready,
            args=(local or instance.url, advertised, what, started, done, registry),
            name="pdplane-vllm-ready",
            daemon=True,
        ).start()
        return run_in_foreground(command, instance.env())
    finally:
        done.set()
        instance.remove_events_dir()
