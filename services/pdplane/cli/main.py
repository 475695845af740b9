"""`pdplane <command> [args]`: dispatches to one module per command.

Each command module exposes `main(argv: list[str]) -> int` and parses its own flags (typed
settings with a `PDPLANE_*` environment variable per flag). Imports are lazy so that
`pdplane ls` does not pay for FastAPI or vLLM.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["COMMANDS", "main"]

#: command -> (module exposing main(argv), one-line help). Adding a command is one line here.
COMMANDS: dict[str, tuple[str, str]] = {
    "registry": ("pdplane.registry.__main__", "run the registry gRPC service"),
    "registry-relay": (
        "pdplane.registry.relay",
        "relay a host's heartbeats to the registry in one message a second (large fleets)",
    ),
    "ls": ("pdplane.cli.ls", "list (or --watch) the instances in a registry"),
    "status": ("pdplane.cli.status", "how a gateway serves each model: pairs, precise routing"),
    "drain": ("pdplane.cli.drain", "stop scheduling onto an instance before removing it"),
    "tokens": (
        "pdplane.cli.bearer_tokens",
        "write random bearer tokens into files once (init step)",
    ),
    "grpc": ("pdplane.cli.grpc", "call any gRPC method by reflection (list, Service/Method JSON)"),
    "scheduler": ("pdplane.scheduler.__main__", "run the scheduler gRPC service"),
    "gateway": ("pdplane.gateway.__main__", "run the OpenAI-compatible gateway"),
    "sim": ("pdplane.sim.__main__", "run simulated vLLM instances (benchmarks, fault injection)"),
    "up": ("pdplane.cli.up", "start registry, scheduler, gateway and a vLLM CPU XpYd fleet"),
    "vllm": ("pdplane.cli.vllm", "start one vLLM CPU instance that joins a running system"),
    "plan": ("pdplane.cli.plan", "how many prefill and decode instances meet an SLO"),
    "profile": ("pdplane.plan.profile_cli", "measure an engine profile from a running instance"),
    "autoscale": ("pdplane.autoscale.__main__", "resize a Kubernetes XpYd fleet while it serves"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "usage: pdplane <command> [options]\n\ncommands:\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pdplane` console script; returns the process exit code."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        sys.stderr.write(f"pdplane: unknown command {name!r}\n\n{_usage()}")
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
