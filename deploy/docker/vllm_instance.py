#!/usr/bin/env python3
"""Container entry of a vLLM CPU instance with the pdplane connector: `pdplane-vllm-cpu`.

Installed in the `vllm-cpu` image as `/usr/local/bin/pdplane-vllm-cpu`. It builds the same
lean vLLM command line as `pdplane up` (`pdplane.launch.vllm_cpu`) from flags or `PDPLANE_*`
environment variables and replaces itself with the vLLM server (exec), so the container's init
signals vLLM directly and `docker stop` is fast.

In a container the server binds 0.0.0.0 but must be reached by its service name: `--advertise-host`
(default: the container's hostname) goes into both the OpenAI URL and the KvTransfer endpoint
the connector registers.

    pdplane-vllm-cpu --role prefill --registry registry:50051 --model /models/tiny
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Literal

from pydantic import Field

from pdplane.core import defaults
from pdplane.core.settings import CommandSettings
from pdplane.launch.vllm_cpu import VllmCpuInstance, VllmCpuOptions

_KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


class InstanceSettings(CommandSettings):
    """One vLLM CPU instance that registers with a pdplane registry."""

    role: Literal["prefill", "decode", "both"] = Field(description="prefill, decode or both")
    registry: str = Field(description="registry gRPC address host:port")
    model: Path = Field(Path("/models/tiny"), description="model directory to serve")
    served_model_name: str = Field("tiny-llama", description="model name clients use")
    port: int = Field(defaults.VLLM_BASE_PORT, ge=1, le=65535, description="OpenAI HTTP port")
    kv_port: int = Field(defaults.KV_BASE_PORT, ge=1, le=65535, description="KvTransfer port")
    advertise_host: str = Field(
        default_factory=socket.gethostname,
        description="host other containers reach this one by (default: the hostname)",
    )
    token: str | None = Field(
        None, description="bearer token required on KvTransfer calls and sent to the registry"
    )
    registry_token: str | None = Field(
        None, description="bearer token for the registry when it differs from --token"
    )
    tls_ca: str | None = Field(
        None, description="PEM CA to verify the registry's and the peers' KvTransfer TLS"
    )
    tls_cert: str | None = Field(None, description="PEM certificate: serve KvTransfer over TLS")
    tls_key: str | None = Field(None, description="PEM private key for --tls-cert")
    omp_threads_bind: str | None = Field(
        None, description="VLLM_CPU_OMP_THREADS_BIND, e.g. '0' to pin to core 0"
    )
    vllm_args: str = Field("", description="extra vLLM flags (one string, split on spaces)")


def build(settings: InstanceSettings) -> tuple[list[str], dict[str, str]]:
    """The vLLM server's argv and environment for `settings` (nothing is started)."""
    host = settings.advertise_host
    extra: dict[str, object] = {"url": f"http://{host}:{settings.port}", "advertise_host": host}
    if settings.tls_ca:
        extra.update(registry_tls_ca=settings.tls_ca, tls_ca=settings.tls_ca)
    if settings.tls_cert or settings.tls_key:
        extra.update(tls_cert=settings.tls_cert, tls_key=settings.tls_key)
    options = VllmCpuOptions(
        model=settings.model,
        port=settings.port,
        host="0.0.0.0",
        role=_KV_ROLES[settings.role],  # type: ignore[arg-type]
        served_model_name=settings.served_model_name,
        kv_port=settings.kv_port,
        registry=settings.registry,
        registry_token=settings.registry_token or settings.token,
        token=settings.token,
        connector_extra=extra,
        omp_threads_bind=settings.omp_threads_bind,
        extra_args=settings.vllm_args.split(),
    )
    instance = VllmCpuInstance(options, log_path=Path(os.devnull))
    return instance.command(), instance.env()


def main(argv: list[str]) -> int:
    settings = InstanceSettings.parse(argv)
    command, env = build(settings)
    sys.stderr.write(f"pdplane-vllm-cpu: exec {' '.join(command[:3])} ({settings.role})\n")
    os.execve(command[0], command, env)
    return 1  # not reached: execve replaces the process or raises OSError


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
