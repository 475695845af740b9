#!/usr/bin/env python3
"""Container entry of a vLLM CPU instance with the pdplane connector: `pdplane-vllm-cpu`.

Installed in the `vllm-cpu` image as `/usr/local/bin/pdplane-vllm-cpu`: `pdplane vllm`
(`pdplane.cli.vllm`) with container defaults. The server binds 0.0.0.0 but must be reached by
its service name, so `--advertise-host` (default: the container's hostname) goes into both the
OpenAI URL and the KvTransfer endpoint the connector registers; the model is the one the
compose `model` service built into /models/tiny.

    pdplane-vllm-cpu --role prefill --registry registry:8051 --model /models/tiny
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from pydantic import Field

from pdplane.cli import vllm
from pdplane.cli.vllm import build

__all__ = ["InstanceSettings", "build", "main"]


class InstanceSettings(vllm.InstanceSettings):
    """One vLLM CPU instance in a container that registers with a pdplane registry."""

    host: str = Field("0.0.0.0", description="address the servers bind")
    model: Path | None = Field(Path("/models/tiny"), description="model directory to serve")
    advertise_host: str | None = Field(
        default_factory=socket.gethostname,
        description="host other containers reach this one by (default: the hostname)",
    )


def main(argv: list[str]) -> int:
    return vllm.main(argv, settings_cls=InstanceSettings)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
