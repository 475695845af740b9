"""Launch a vLLM CPU instance (optionally with pdplane's KV connector) as a supervised child.

The lean settings measured on CPU machines (docs/connector.md): float32, eager mode, the `uni`
executor, no engine multiprocessing, a small fixed KV cache. Every instance of a P/D pair must
use identical settings (layouts and numerics must match). Used by `pdplane up`, the end-to-end
tests and the docker image::

    inst = VllmCpuInstance(VllmCpuOptions(model=path, port=8100, role="kv_producer",
                                          kv_port=8200, registry="127.0.0.1:8051"),
                           log_path=Path("prefill.log"))
    inst.start(); inst.wait_healthy(180); ...; inst.stop()
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pdplane.core import tracing
from pdplane.launch.process import ManagedProcess, http_ok, wait_until

__all__ = [
    "KvRole",
    "VllmCpuInstance",
    "VllmCpuOptions",
    "connector_config",
    "kv_events_config",
    "serve_argv",
]

KvRole = Literal["kv_producer", "kv_consumer", "kv_both"]

#: Environment every lean vLLM CPU instance gets (offline, no telemetry, 1 GiB KV space,
#: engine core in-process).
LEAN_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


@dataclass
class VllmCpuOptions:
    """Settings of one instance.

    Attributes:
        model: model directory (e.g. from `pdplane.models.tiny.build_tiny_model`).
        port: OpenAI HTTP port.
        host: bind host of the HTTP server.
        role: kv_role of the pdplane connector; None = plain vLLM (no connector).
        served_model_name: name in /v1/models (default: vLLM's, the model path).
        kv_port: KvTransfer gRPC port of the connector (rank 0); required with `registry`.
        registry: registry address host:port; None = the instance does not register.
        registry_token: bearer token for the registry.
        token: bearer token of the KvTransfer service (same on every instance of a fleet).
        instance_id: registry instance id (default: derived by the connector).
        transfer_timeout_s: prefill frees held blocks after this long (s); None = default.
        pull_timeout_s: decode gives up a pull after this long (s); None = default.
        connector_extra: more `kv_connector_extra_config` keys (override the above).
        kv_load_failure_policy: vLLM's reaction to a failed pull: "fail" or "recompute".
        max_model_len: tokens; num_gpu_blocks: KV cache blocks (`--num-gpu-blocks-override`).
        dtype: model dtype; prefix_caching: vLLM's own prefix cache.
        shutdown_timeout_s: vLLM's `--shutdown-timeout` (s): on SIGTERM the engine drains
            running requests this long, and its connector gets to deregister (0, vLLM's
            default, kills the engine at once: the registry then learns only at lease expiry).
        kv_events: with a connector and prefix caching, have vLLM publish its KV cache events
            to a private `ipc://` socket the connector re-publishes as `pdplane.v1.KvEvents`
            (ignored when `extra_args` already carry `--kv-events-config`).
        omp_threads_bind: `VLLM_CPU_OMP_THREADS_BIND` (e.g. "0" to pin to core 0).
        extra_args: more vLLM flags; extra_env: more environment variables.
    """

    model: Path
    port: int
    host: str = "127.0.0.1"
    role: KvRole | None = None
    served_model_name: str | None = None
    kv_port: int | None = None
    registry: str | None = None
    registry_token: str | None = None
    token: str | None = None
    instance_id: str | None = None
    transfer_timeout_s: float | None = None
    pull_timeout_s: float | None = None
    connector_extra: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"
    max_model_len: int = 1024
    num_gpu_blocks: int = 64
    dtype: str = "float32"
    prefix_caching: bool = True
    shutdown_timeout_s: int = 5
    kv_events: bool = True
    omp_threads_bind: str | None = None
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def connector_config(options: VllmCpuOptions) -> dict[str, Any] | None:
    """The `--kv-transfer-config` object for `options` (None without a role)."""
    if options.role is None:
        return None
    extra: dict[str, Any] = {"url": options.url, "kv_host": options.host}
    optional = {
        "kv_port": options.kv_port,
        "registry": options.registry,
        "instance_id": options.instance_id,
        "transfer_timeout_s": options.transfer_timeout_s,
        "pull_timeout_s": options.pull_timeout_s,
    }
    extra.update({k: v for k, v in optional.items() if v is not None})
    extra.update(options.connector_extra)
    config: dict[str, Any] = {
        "kv_connector": "PdPlaneConnector",
        "kv_connector_module_path": "pdplane.connector",
        "kv_role": options.role,
        "kv_connector_extra_config": extra,
    }
    if options.kv_load_failure_policy != "fail":  # key unknown to older vLLM; "fail" is default
        config["kv_load_failure_policy"] = options.kv_load_failure_policy
    return config


def kv_events_config(endpoint: str) -> dict[str, Any]:
    """The `--kv-events-config` object that makes vLLM publish its KV cache events to
    `endpoint` (e.g. `ipc:///run/pdplane/kv-events.ipc`), where the connector reads them."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}


@functools.cache
def _has_serve_command() -> bool:
    """Whether the installed vLLM has the `vllm serve` command (0.26 and 0.32 do; it came in
    0.5), read from its files without importing vLLM; True when vLLM is not installed here."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return True
    return (Path(spec.origin).parent / "entrypoints" / "cli" / "serve.py").is_file()


def serve_argv(python: str, model: Path | str) -> list[str]:
    """The start of a vLLM server's argv, launched as `vllm serve MODEL` launches it.

    vLLM's CLI runs through `pdplane.cli.vllm_console` (`python -m`, so it is this venv's and
    works under vllm-cpu, whose own `vllm` script fails); an older vLLM without `vllm serve`
    gets the module vLLM now deprecates, `python -m vllm.entrypoints.openai.api_server
    --model MODEL`. Either way the API server is this process, its engine core a child."""
    if _has_serve_command():
        return [python, "-m", "pdplane.cli.vllm_console", "serve", str(model)]
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]


class VllmCpuInstance:
    """One vLLM CPU server process: `start()`, `wait_healthy()`, `stop()` (or `with`).

    `stop()` ends the whole process group (API server and engine core), so no orphan is left
    even when vLLM spawned children.
    """

    def __init__(
        self,
        options: VllmCpuOptions,
        log_path: Path,
        python: str = sys.executable,
        base_env: Mapping[str, str] | None = None,
    ) -> None:
        self.options = options
        self.log_path = log_path
        self._python = python
        self._base_env = dict(os.environ if base_env is None else base_env)
        # The events socket lives in a directory only this user can open (mkdtemp: 0700).
        self._events_dir: Path | None = None
        wants_events = options.role and options.prefix_caching and options.kv_events
        if wants_events and "--kv-events-config" not in options.extra_args:
            self._events_dir = Path(tempfile.mkdtemp(prefix="pdplane-kvev-"))
        name = options.role or "vllm"
        self.process = ManagedProcess(
            f"{name}:{options.port}", self.command(), log_path, self.env()
        )

    @property
    def url(self) -> str:
        """OpenAI base URL, e.g. http://127.0.0.1:8100 (no /v1)."""
        return self.options.url

    @property
    def kv_endpoint(self) -> str | None:
        """host:port of the connector's KvTransfer server (None without a fixed kv_port)."""
        o = self.options
        return f"{o.host}:{o.kv_port}" if o.role and o.kv_port else None

    def command(self) -> list[str]:
        """The full argv of the server process."""
        o = self.options
        argv = [
            *serve_argv(self._python, o.model),
            "--host",
            o.host,
            "--port",
            str(o.port),
            "--max-model-len",
            str(o.max_model_len),
            "--dtype",
            o.dtype,
            "--enforce-eager",
            "--distributed-executor-backend",
            "uni",
            "--num-gpu-blocks-override",
            str(o.num_gpu_blocks),
            "--shutdown-timeout",
            str(o.shutdown_timeout_s),
        ]
        if o.served_model_name:
            argv += ["--served-model-name", o.served_model_name]
        if not o.prefix_caching:
            argv.append("--no-enable-prefix-caching")
        kv = connector_config(o)
        if kv is not None:
            argv += ["--kv-transfer-config", json.dumps(kv)]
        if self._events_dir is not None:
            endpoint = f"ipc://{self._events_dir / 'kv-events.ipc'}"
            argv += ["--kv-events-config", json.dumps(kv_events_config(endpoint))]
        otlp = tracing.traces_endpoint(self.env())
        if otlp and "--otlp-traces-endpoint" not in o.extra_args:
            # vLLM's own request spans, in the trace the gateway's `traceparent` names.
            argv += ["--otlp-traces-endpoint", otlp]
        return argv + list(o.extra_args)

    def env(self) -> dict[str, str]:
        """The server's environment: the caller's, plus the lean settings (and, when traces
        are on, the instance's name as `OTEL_SERVICE_NAME` unless the caller set one)."""
        env = {**self._base_env, **LEAN_ENV}
        if self.options.omp_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.options.omp_threads_bind
        # The connector reads its tokens from here (`ConnectorConfig.from_extra_config`): in
        # --kv-transfer-config they would be in argv, which `ps` shows to every user.
        for name, value in (
            ("PDPLANE_TOKEN", self.options.token),
            ("PDPLANE_REGISTRY_TOKEN", self.options.registry_token),
        ):
            if value:
                env[name] = value
        env.update(self.options.extra_env)
        if tracing.env_enabled(env) and "OTEL_SERVICE_NAME" not in env:
            o = self.options
            env["OTEL_SERVICE_NAME"] = o.instance_id or f"vllm-{o.role or 'instance'}-{o.port}"
        return env

    def start(self) -> None:
        """Starts the server (returns at once). Raises RuntimeError if already running."""
        if self._events_dir is not None:  # again after a stop()
            self._events_dir.mkdir(mode=0o700, exist_ok=True)
        self.process.start()

    def healthy(self) -> bool:
        """True when GET /health answers 200."""
        return http_ok(f"{self.url}/health")

    def wait_healthy(self, timeout: float = 180.0) -> None:
        """Waits until /health answers 200. Raises ProcessDied (with the log's tail) if the
        server exits first, TimeoutError after `timeout` seconds."""
        wait_until(
            self.healthy,
            timeout,
            interval_s=0.5,
            watch=[self.process],
            what=f"vLLM at {self.url} to become healthy",
        )

    def alive(self) -> bool:
        return self.process.alive()

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace_s` seconds, to the whole process group."""
        code = self.process.stop(grace_s)
        self.remove_events_dir()
        return code

    def remove_events_dir(self) -> None:
        """Removes the private folder of the KV events socket (`start()` makes it again): for
        a caller that runs `command()` itself, once the server has exited."""
        if self._events_dir is not None:
            shutil.rmtree(self._events_dir, ignore_errors=True)

    def __enter__(self) -> VllmCpuInstance:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
