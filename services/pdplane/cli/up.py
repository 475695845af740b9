"""`pdplane up`: the embedded default on one machine, no GPU, no Docker.

Builds (once, cached) a tiny Llama model unless `--model` names one, then starts the registry,
the scheduler, the gateway and an XpYd fleet of vLLM CPU instances with the pdplane connector
(1P1D by default), waits until the gateway reports a usable pair, prints where everything is,
optionally sends one OpenAI request (`--demo`), and serves until Ctrl-C / SIGTERM, when it stops
every child (process groups, bounded) so that nothing is left behind; the children also get
SIGTERM if `pdplane up` itself is killed. A vLLM instance that exits while serving is reported
and the rest keep serving (the registry drops it within its lease TTL); a registry, scheduler
or gateway that exits is restarted on its port (instances re-register and watchers re-watch by
themselves), and `pdplane up` gives up with status 1 only when one crashes more than three
times in a minute.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Literal

from pydantic import Field

from pdplane.core import defaults
from pdplane.core.settings import CommandSettings
from pdplane.launch.fleet import Fleet, FleetSpec
from pdplane.launch.process import Cancelled

__all__ = ["UpSettings", "main"]


class UpSettings(CommandSettings):
    """Start registry, scheduler, gateway and a vLLM CPU XpYd fleet on this machine."""

    prefill: int = Field(1, ge=1, le=16, description="prefill (kv_producer) vLLM instances")
    decode: int = Field(1, ge=1, le=16, description="decode (kv_consumer) vLLM instances")
    host: str = Field("127.0.0.1", description="address every service listens on")
    gateway_port: int = Field(defaults.GATEWAY_PORT, ge=1, le=65535, description="gateway HTTP")
    registry_port: int = Field(defaults.REGISTRY_PORT, ge=1, le=65535, description="registry gRPC")
    scheduler_port: int = Field(
        defaults.SCHEDULER_PORT, ge=1, le=65535, description="scheduler gRPC"
    )
    vllm_base_port: int = Field(
        defaults.VLLM_BASE_PORT, ge=1, le=65000, description="first vLLM HTTP port"
    )
    kv_base_port: int = Field(
        defaults.KV_BASE_PORT, ge=1, le=65000, description="first connector KvTransfer port"
    )
    model: Path | None = Field(
        None, description="model directory to serve (default: a tiny Llama built locally)"
    )
    served_model_name: str | None = Field(
        None, description="model name clients use (default: 'tiny-llama' or the folder name)"
    )
    vllm_args: str = Field("", description="extra arguments for every vLLM instance (one string)")
    kv_mode: Literal["pull", "push"] = Field(
        "pull", description="KV hand-off: decode pulls (default) or prefill pushes layer by layer"
    )
    prefill_policy: str = Field("least_loaded", description="scheduler prefill policy")
    decode_policy: str = Field("least_loaded", description="scheduler decode policy")
    log_dir: Path = Field(Path("logs"), description="folder for every process's log")
    ready_timeout_s: float = Field(600.0, gt=0, description="give up starting after (s)")
    demo: bool = Field(False, description="send one chat request once ready and print it")
    exit_after_demo: bool = Field(False, description="with --demo: stop everything afterwards")


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
        self._per_minute = per_minute
        self._times: dict[str, list[float]] = {}

    def allow(self, name: str) -> bool:
        now = time.monotonic()
        recent = [t for t in self._times.get(name, []) if now - t < 60.0]
        self._times[name] = [*recent, now]
        return len(recent) < self._per_minute


def _say(message: str) -> None:
    sys.stdout.write(f"[pdplane up] {message}\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    """Runs `pdplane up`; returns 0 after a clean Ctrl-C/SIGTERM, 1 if a child failed."""
    settings = UpSettings.parse(argv)
    stop = _Stop()
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)

    spec = FleetSpec.from_settings(settings)
    fleet = Fleet(spec, say=_say)
    fleet.die_with_parent = True
    status = 0
    try:
        fleet.start(cancel=stop.event)
        _say(f"ready in {fleet.ready_after_s:.0f} s")
        _say(f"  gateway (OpenAI API): {fleet.gateway_url}/v1   model: {fleet.model_name}")
        _say(f"  registry (gRPC):      {fleet.registry_address}   try: pdplane ls")
        _say(f"  scheduler (gRPC):     {fleet.scheduler_address}")
        _say(f"  logs:                 {spec.log_dir.resolve()}")
        if settings.demo:
            _say("demo request: POST /v1/chat/completions")
            _say(f"  answer: {fleet.demo_request()!r}")
            if settings.exit_after_demo:
                return 0
        _say("serving; Ctrl-C stops everything")
        restarts = _RestartBudget(per_minute=3)
        while not stop.event.wait(1.0):
            for name, inst in fleet.newly_dead_instances():
                _say(
                    f"{name} exited with status {inst.process.returncode} (log {inst.log_path}); "
                    "the other instances keep serving"
                )
            failed = fleet.dead_service()
            if failed is not None:
                _say(f"{failed.name} exited with status {failed.returncode}; restarting it")
                if not restarts.allow(failed.name):
                    _say(f"{failed.name} keeps failing; giving up:\n{failed.tail()}")
                    status = 1
                    break
                # The instances re-register and the scheduler/gateway re-watch by themselves.
                failed.start()
    except Cancelled:
        _say("interrupted during start-up")
    except (TimeoutError, RuntimeError) as exc:
        _say(f"error: {exc}")
        status = 1
    finally:
        _say("stopping")
        started = time.monotonic()
        fleet.stop()
        _say(f"stopped in {time.monotonic() - started:.1f} s")
    return status
