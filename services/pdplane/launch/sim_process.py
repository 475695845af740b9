"""One `pdplane sim` instance as a supervised child process (`pdplane up --engine sim`).

The simulator stands in for a vLLM instance (same OpenAI API, registration, KvTransfer and
KV events) at no model cost: a fleet of them starts in seconds on a machine without a GPU.
Tokens travel in its environment (`PDPLANE_REGISTRY_TOKEN`, `PDPLANE_KV_TOKEN`), never argv.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdplane.launch.process import ManagedProcess, http_ok

__all__ = ["SimOptions", "SimProcess"]

#: the sim's role names for the connector's KV roles
_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


@dataclass
class SimOptions:
    """What one sim serves and where: `role` is a KV role (kv_producer | kv_consumer |
    kv_both); `profile` a `pdplane sim --profile` name or JSON file; `tokenizer` a Hugging Face
    tokenizer folder the sim tokenizes with and publishes (None: its word tokenizer, unpublished).
    """

    role: str
    port: int
    kv_port: int
    registry: str
    instance_id: str
    model: str
    host: str = "127.0.0.1"
    profile: str = "tiny-cpu"
    token: str | None = None
    tokenizer: Path | None = None
    #: context length (tokens); None = the profile's
    max_model_len: int | None = None
    extra_args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class SimProcess:
    """`start()`, `healthy()`, `stop()` of one sim; `process` is its `ManagedProcess`."""

    def __init__(self, options: SimOptions, log_path: Path, python: str = sys.executable):
        self.options = options
        self.process = ManagedProcess(
            options.instance_id, self.command(python), log_path, env=self.env()
        )

    @property
    def url(self) -> str:
        return self.options.url

    @property
    def kv_endpoint(self) -> str:
        return f"{self.options.host}:{self.options.kv_port}"

    def command(self, python: str = sys.executable) -> list[str]:
        o = self.options
        argv: Sequence[str] = [
            python,
            "-m",
            "pdplane.cli.main",
            "sim",
            "--role",
            _ROLES[o.role],
            "--host",
            o.host,
            "--port",
            str(o.port),
            "--kv-port",
            str(o.kv_port),
            "--registry",
            o.registry,
            "--instance-id",
            o.instance_id,
            "--model",
            o.model,
            "--profile",
            o.profile,
        ]
        if o.tokenizer is not None:
            argv = [*argv, "--tokenizer", str(o.tokenizer)]
        if o.max_model_len is not None:
            argv = [*argv, "--max-model-len", str(o.max_model_len)]
        return [*argv, *o.extra_args]

    def env(self) -> dict[str, str]:
        env = {**os.environ}
        for name in ("PDPLANE_REGISTRY_TOKEN", "PDPLANE_KV_TOKEN"):
            env.pop(name, None)
            if self.options.token:
                env[name] = self.options.token
        return env

    def start(self) -> None:
        """Starts the sim (returns at once)."""
        self.process.start()

    def healthy(self) -> bool:
        """True when GET /health answers 200."""
        return http_ok(f"{self.url}/health")

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM (the sim deregisters), SIGKILL after `grace_s` seconds."""
        return self.process.stop(grace_s)
