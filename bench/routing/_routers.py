"""The routers a routing benchmark compares, by row name, all over the same sim fleet.

Row names:
- `pdplane:P[/D][+flag=value...]`: the pdplane gateway with the scheduler embedded
  (`--scheduler embedded`), prefill policy P and decode policy D (default D = P); any name the
  gateway accepts (`round_robin`, `random`, `least_loaded`, `power_of_two`, `consistent_hash`,
  `kv_aware`, ...); `POLICY_FLAGS` adds the flags a policy needs; each `+flag=value` adds the
  gateway flag `--flag value` (e.g. `pdplane:kv_aware+kv-local-slack=0`);
- `vllm-router:P[/D]`: vllm-router in `--vllm-pd-disaggregation` mode with `--prefill-policy
  P --decode-policy D` (`cache_aware`, `power_of_two`, `round_robin`, `random`, ...);
- `xpyd:S`: xpyd-proxy with `scheduling: S` (`cache_aware`, `roundrobin`, `loadbalanced`, ...);
- `oracle`: the fleet's own oracle router (bench/routing/_oracle.py);
- `seed-proxy:random`: the seed proxy's random P and D choice, in the fleet
  (bench/routing/_oracle.py);
  unlike `pdplane:random` it has no KV-room guard, as the seed's proxy had none.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from bench._procs import spawn
from bench.relay.proxies import PEERS_DIR, ProxyRun, install_hint, wait_ready
from pdplane.launch.ports import free_port_run

__all__ = ["POLICY_FLAGS", "Endpoints", "Row", "parse_row", "start_row"]

#: Extra gateway flags a pdplane policy needs (e.g. a tokenizer for prefix hashes); the
#: `{tokenizer}` placeholder is the fleet's tokenizer directory.
POLICY_FLAGS: dict[str, list[str]] = {
    # exact prompt token ids and prefix block hashes (the sims must use the same tokenizer)
    "kv_aware": ["--tokenizer", "{tokenizer}"],
}


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    kind: str
    prefill: str
    decode: str
    #: extra gateway flags from the row's `+flag=value` suffixes (pdplane rows only)
    flags: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where a started fleet serves: its registry, instances and (maybe) oracle."""

    registry: str
    prefill: list[str]
    decode: list[str]
    oracle: str | None = None
    model: str = "sim-model"
    tokenizer: str = ""


_FLAG = re.compile(r"[a-z][a-z0-9-]*")


def parse_row(name: str) -> Row:
    """A row from its name (see the module docstring). Raises ValueError."""
    kind, _, spec = name.partition(":")
    if (kind, spec) in (("oracle", ""), ("seed-proxy", "random")):
        return Row(name, "oracle", "", "")
    if kind not in ("pdplane", "vllm-router", "xpyd") or not spec:
        raise ValueError(
            f"bad row {name!r}: pdplane:P[/D], vllm-router:P[/D], xpyd:S, oracle, seed-proxy:random"
        )
    spec, *extras = spec.split("+")
    flags: list[str] = []
    for extra in extras:
        flag, eq, value = extra.partition("=")
        if kind != "pdplane" or not eq or not value or not _FLAG.fullmatch(flag):
            raise ValueError(f"bad row {name!r}: a suffix is +flag=value, on pdplane rows only")
        flags += [f"--{flag}", value]
    prefill, _, decode = spec.partition("/")
    return Row(name, kind, prefill, decode or prefill, tuple(flags))


def _pdplane(row: Row, ep: Endpoints, cpus: str, logs: Path, dispatch: str) -> ProxyRun:
    port = free_port_run()
    argv = [sys.executable, "-m", "pdplane.cli.main", "gateway", "--scheduler", "embedded"]
    argv += ["--prefill-policy", row.prefill, "--decode-policy", row.decode, "--seed", "0"]
    argv += ["--registry", ep.registry, "--port", str(port), "--dispatch", dispatch]
    argv += ["--log-level", "warning", "--upstream-timeout-s", "3600"]
    for policy in sorted({row.prefill, row.decode}):
        if policy in POLICY_FLAGS and not ep.tokenizer:
            raise RuntimeError(f"{policy} needs the fleet's tokenizer (run with --tokenizer tiny)")
        argv += [f.format(tokenizer=ep.tokenizer) for f in POLICY_FLAGS.get(policy, [])]
    argv += row.flags
    proc = spawn(f"pdplane-{row.prefill}-{row.decode}-{dispatch}", argv, cpus, logs)
    return ProxyRun(row.name, f"http://127.0.0.1:{port}", [proc])


def _vllm_router(row: Row, ep: Endpoints, cpus: str, logs: Path) -> ProxyRun:
    port = free_port_run()
    argv = [str(PEERS_DIR / "vllm-router" / "bin" / "vllm-router"), "--vllm-pd-disaggregation"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    argv += ["--prefill-policy", row.prefill, "--decode-policy", row.decode]
    argv += ["--prometheus-port", str(free_port_run()), "--request-timeout-secs", "3600"]
    for url in ep.prefill:
        argv += ["--prefill", url]
    for url in ep.decode:
        argv += ["--decode", url]
    proc = spawn(f"vllm-router-{row.prefill}-{row.decode}", argv, cpus, logs)
    return ProxyRun(row.name, f"http://127.0.0.1:{port}", [proc])


def _xpyd(row: Row, ep: Endpoints, cpus: str, logs: Path) -> ProxyRun:
    port = free_port_run()
    lines = [
        f'model: "{ep.model}"',
        f"port: {port}",
        'log_level: "warning"',
        f'scheduling: "{row.prefill}"',
        "disaggregated_mode: nixl",
        "startup:",
        "  wait_timeout_seconds: 60",
        "  probe_interval_seconds: 1",
        "instances:",
    ]
    for role, urls in (("prefill", ep.prefill), ("decode", ep.decode)):
        for url in urls:
            lines += [
                f'  - address: "{url.removeprefix("http://")}"',
                f'    role: "{role}"',
                f'    model: "{ep.model}"',
            ]
    config = logs / f"xpyd-{row.prefill}.yaml"
    config.write_text("\n".join(lines) + "\n")
    # Offline: without a local tokenizer xpyd splits on whitespace instead of downloading one.
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    binary = PEERS_DIR / "xpyd-proxy" / "bin" / "xpyd"
    argv = [str(binary), "--config", str(config), "--disaggregated-mode", "nixl"]
    proc = spawn(f"xpyd-{row.prefill}", argv, cpus, logs, env=env)
    return ProxyRun(row.name, f"http://127.0.0.1:{port}", [proc])


def start_row(
    row: Row, ep: Endpoints, cpus: str, logs: Path, *, dispatch: str = "sequential"
) -> ProxyRun:
    """Starts the router of `row` over `ep` and waits until it relays a request.

    Raises RuntimeError when it does not come up or its peer is not installed.
    """
    if row.kind == "oracle":
        if not ep.oracle:
            raise RuntimeError("the fleet runs no in-fleet router (start it with --router)")
        run = ProxyRun(row.name, ep.oracle)
    elif row.kind == "pdplane":
        run = _pdplane(row, ep, cpus, logs, dispatch)
    else:
        peer = "vllm-router" if row.kind == "vllm-router" else "xpyd-proxy"
        hint = install_hint(peer)
        if hint:
            raise RuntimeError(f"{peer} is not installed: {hint}")
        run = (
            _vllm_router(row, ep, cpus, logs)
            if row.kind == "vllm-router"
            else _xpyd(row, ep, cpus, logs)
        )
    try:
        wait_ready(run, ep.model)
    except BaseException:
        run.stop()
        raise
    return run
