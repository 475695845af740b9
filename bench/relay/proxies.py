"""The proxies under test, each started over the same sims: pdplane, vllm-router, xpyd-proxy,
and the floor of pdplane's libraries (`python-floor`, `bench/relay/_floor_proxy.py`).

Peers live in their own virtual environments outside the repository (`.cache/peers/`, git
ignored); `missing()` says how to install one that is absent.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench._procs import Proc, spawn
from pdplane.launch.ports import free_port_run

__all__ = [
    "PEERS_DIR",
    "Fleet",
    "ProxyRun",
    "check_name",
    "install_hint",
    "start_proxy",
    "wait_ready",
]

from bench import ROOT

#: The command line that starts a pdplane proxy's gateway, up to its flags.
_GATEWAY_ARGV = (sys.executable, "-m", "pdplane.cli.main", "gateway")
PEERS_DIR = ROOT / ".cache" / "peers"
_PEER_BIN = {
    "vllm-router": PEERS_DIR / "vllm-router" / "bin" / "vllm-router",
    "xpyd-proxy": PEERS_DIR / "xpyd-proxy" / "bin" / "xpyd",
}


def install_hint(peer: str) -> str | None:
    """None when `peer` is installed, else the commands that install it."""
    path = _PEER_BIN.get(peer)
    if path is None or path.exists():
        return None
    venv = path.parents[1]
    return f"python3 -m venv {venv} && {venv}/bin/pip install {peer}"


@dataclass
class Fleet:
    """The sims of one topology: URLs by role and the registry they registered with."""

    registry: str
    prefill: list[str]
    decode: list[str]
    model: str = "sim-model"
    #: Hugging Face tokenizer directory the sims use ("" = their word tokenizer); pdplane
    #: variants with `+tok` give it to the gateway too (exact prompt ids, prefix hashes).
    tokenizer: str = ""


@dataclass
class ProxyRun:
    """A started proxy: its base URL and the processes whose CPU time counts as proxy CPU."""

    name: str
    url: str
    procs: list[Proc] = field(default_factory=list)

    def cpu_ms(self) -> float:
        return sum(p.cpu_ms() for p in self.procs)

    def cpu_split(self) -> dict[str, float]:
        """CPU time (ms) so far per process name (pdplane: gateway and scheduler apart)."""
        return {p.name: p.cpu_ms() for p in self.procs}

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def wait_ready(run: ProxyRun, model: str, timeout_s: float = 90.0, precise: bool = False) -> None:
    """Waits until `run` relays a small chat request and, with `precise` (a pdplane gateway
    over sims that publish a tokenizer), until its /health says `model` is routed precisely:
    the gateway has fetched and checked the fleet's tokenizer (seconds after it starts, with
    its CPU), so that no measured window holds the fetch or estimated prompts. RuntimeError
    after `timeout_s`."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "warm up"}],
        "max_tokens": 2,
        "stream": False,
    }
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        for p in run.procs:
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} exited; see its log")
        try:
            r = httpx.post(run.url + "/v1/chat/completions", json=body, timeout=5)
            if r.status_code == 200 and r.json()["choices"][0]["message"]["content"]:
                if not precise:
                    return
                state = httpx.get(run.url + "/health", timeout=5).json()["models"][model]
                if state.get("routing") == "precise":
                    return
                last = f"routing {state.get('routing')}: {state.get('routing_reason')}"
            else:
                last = f"HTTP {r.status_code}: {r.text[:200]}"
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            last = repr(exc)
        time.sleep(0.25)
    raise RuntimeError(f"{run.name} not ready after {timeout_s} s: {last}")


#: Variants of a pdplane proxy, appended to its name with "+" (e.g. "pdplane-embedded+tok"):
#: tok = the gateway is handed the sims' tokenizer folder itself (`--tokenizer`, which overrides
#: the one the fleet publishes; with the sims publishing one, every gateway takes it from the
#: fleet anyway); kv_aware = the kv_aware policy on both sides (the scheduler's default; the
#: benchmark's pdplane proxies run round_robin otherwise; precise only with a tokenizer);
#: access-log = the gateway logs at INFO, so that its access log (on by default, one line per
#: request) is written; no-kv-index = no prefix
#: index fed by the instances' KV events (`--no-kv-index`); unary = a remote gateway's Schedules
#: as unary calls instead of on one ScheduleStream (`--no-schedule-stream`); base = the
#: gateway and scheduler run the code of another checkout, `PDPLANE_BENCH_BASE_TREE` (an A/B
#: of two trees in one run); ft-decode = streamed requests take their first token from decode
#: (`PDPLANE_FIRST_TOKEN=decode`) instead of prefill, the default.
VARIANTS = (
    "tok",
    "kv_aware",
    "access-log",
    "no-kv-index",
    "unary",
    "base",
    "ft-decode",
)


def _tree_env(variants: frozenset[str]) -> dict[str, str] | None:
    """The environment added to a pdplane proxy's processes: "+base", the base tree's code
    first; "+ft-decode", the first token from decode."""
    env: dict[str, str] = {}
    if "ft-decode" in variants:
        env["PDPLANE_FIRST_TOKEN"] = "decode"
    if "base" in variants:
        tree = os.environ.get("PDPLANE_BENCH_BASE_TREE", "")
        if not tree:
            raise RuntimeError("+base needs PDPLANE_BENCH_BASE_TREE (a checkout to compare with)")
        # A path without pdplane's code would not fail: `pdplane` is a namespace package, so
        # the installed code would run as the base, compared with itself.
        if not (Path(tree) / "services" / "pdplane" / "gateway").is_dir():
            raise RuntimeError(f"PDPLANE_BENCH_BASE_TREE={tree} is not a pdplane checkout")
        env["PYTHONPATH"] = f"{tree}/services:{tree}/connector"
    return env or None


def _variant_flags(variants: frozenset[str], fleet: Fleet) -> tuple[list[str], list[str]]:
    """(policy + index flags, gateway tokenizer flags) of a pdplane proxy's `variants`."""
    unknown = variants - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown pdplane variant(s) {sorted(unknown)}; known: {VARIANTS}")
    policy = "kv_aware" if "kv_aware" in variants else "round_robin"
    flags = ["--prefill-policy", policy, "--decode-policy", policy]
    if "no-kv-index" in variants:
        flags.append("--no-kv-index")
    tok: list[str] = []
    if "tok" in variants:
        if not fleet.tokenizer:
            raise RuntimeError("+tok needs the sims' tokenizer (--tokenizer)")
        tok = ["--tokenizer", fleet.tokenizer]
    return flags, tok


def _log_level(variants: frozenset[str]) -> list[str]:
    """The gateway's log level: INFO writes its access log (`+access-log`), WARNING does not."""
    return ["--log-level", "info" if "access-log" in variants else "warning"]


def _pdplane(
    fleet: Fleet,
    cpus: str,
    logs: Path,
    dispatch: str,
    variants: frozenset[str] = frozenset(),
    name: str = "",
) -> ProxyRun:
    sched_port, gw_port = free_port_run(), free_port_run()
    py = sys.executable
    policy, tok = _variant_flags(variants, fleet)
    # Each variant's logs in files of their own ("+access-log" has its access log there).
    tail = "".join(f"+{v}" for v in sorted(variants))
    scheduler = spawn(
        f"pdplane-scheduler{tail}",
        [
            py,
            "-m",
            "pdplane.cli.main",
            "scheduler",
            "--registry",
            fleet.registry,
            "--port",
            str(sched_port),
            *policy,
        ],
        cpus,
        logs,
        env=_tree_env(variants),
    )
    gateway = spawn(
        f"pdplane-gateway-{dispatch}{tail}",
        [
            *_GATEWAY_ARGV,
            "--scheduler",
            f"127.0.0.1:{sched_port}",
            "--registry",
            fleet.registry,
            "--port",
            str(gw_port),
            "--dispatch",
            dispatch,
            *(["--no-kv-index"] if "no-kv-index" in variants else []),
            *(["--no-schedule-stream"] if "unary" in variants else []),
            *tok,
            *_log_level(variants),
        ],
        cpus,
        logs,
        env=_tree_env(variants),
    )
    url = f"http://127.0.0.1:{gw_port}"
    return ProxyRun(name or f"pdplane-{dispatch}", url, [scheduler, gateway])


def _pdplane_embedded(
    fleet: Fleet, cpus: str, logs: Path, variants: frozenset[str], name: str
) -> ProxyRun:
    # The scheduler's decision code inside the gateway: no gRPC on the request path.
    gw_port = free_port_run()
    if "unary" in variants:
        raise ValueError("+unary is for a remote scheduler (pdplane, pdplane-concurrent)")
    policy, tok = _variant_flags(variants, fleet)
    gateway = spawn(
        "pdplane-gateway-embedded" + "".join(f"+{v}" for v in sorted(variants)),
        [
            *_GATEWAY_ARGV,
            "--scheduler",
            "embedded",
            *policy,
            *tok,
            "--registry",
            fleet.registry,
            "--port",
            str(gw_port),
            *_log_level(variants),
        ],
        cpus,
        logs,
        env=_tree_env(variants),
    )
    return ProxyRun(name, f"http://127.0.0.1:{gw_port}", [gateway])


def _vllm_router(fleet: Fleet, cpus: str, logs: Path) -> ProxyRun:
    port = free_port_run()
    argv = [
        str(_PEER_BIN["vllm-router"]),
        "--vllm-pd-disaggregation",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        "round_robin",
        "--log-level",
        "warning",
        "--prometheus-port",
        str(free_port_run()),
    ]
    for url in fleet.prefill:
        argv += ["--prefill", url]
    for url in fleet.decode:
        argv += ["--decode", url]
    proc = spawn("vllm-router", argv, cpus, logs)
    return ProxyRun("vllm-router", f"http://127.0.0.1:{port}", [proc])


def _xpyd(fleet: Fleet, cpus: str, logs: Path) -> ProxyRun:
    port = free_port_run()
    lines = [
        f'model: "{fleet.model}"',
        f"port: {port}",
        'log_level: "warning"',
        'scheduling: "roundrobin"',
        "disaggregated_mode: nixl",
        "startup:",
        "  wait_timeout_seconds: 60",
        "  probe_interval_seconds: 1",
        "instances:",
    ]
    for role, urls in (("prefill", fleet.prefill), ("decode", fleet.decode)):
        for url in urls:
            address = url.removeprefix("http://")
            lines += [
                f'  - address: "{address}"',
                f'    role: "{role}"',
                f'    model: "{fleet.model}"',
            ]
    config = logs / "xpyd.yaml"
    config.write_text("\n".join(lines) + "\n")
    # Offline: without a local tokenizer xpyd falls back to round robin instead of downloading.
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = spawn(
        "xpyd-proxy",
        [str(_PEER_BIN["xpyd-proxy"]), "--config", str(config), "--disaggregated-mode", "nixl"],
        cpus,
        logs,
        env=env,
    )
    return ProxyRun("xpyd-proxy", f"http://127.0.0.1:{port}", [proc])


#: The floor relays (`bench/relay/_floor_proxy.py`) by name: the app under uvicorn.
_FLOOR_APPS = {"python-floor": "asgi", "python-floor-fastapi": "fastapi"}


def _floor(fleet: Fleet, cpus: str, logs: Path, name: str) -> ProxyRun:
    # A fixed 1P1D pair: the first prefill and the first decode of the fleet.
    port = free_port_run()
    argv = [sys.executable, "-m", "bench.relay._floor_proxy", "--app", _FLOOR_APPS[name]]
    argv += ["--prefill", fleet.prefill[0], "--decode", fleet.decode[0], "--port", str(port)]
    proc = spawn(name, argv, cpus, logs)
    return ProxyRun(name, f"http://127.0.0.1:{port}", [proc])


#: Proxy names without variants (`start_proxy`).
_NAMES = ("direct", "pdplane", "pdplane-sequential", "pdplane-concurrent", "pdplane-embedded")
_PEERS = ("vllm-router", "xpyd-proxy")


def check_name(name: str) -> None:
    """Raises ValueError naming what is wrong when `start_proxy` does not know `name`."""
    base, *rest = name.split("+")
    known = (*_NAMES, *_PEERS, *_FLOOR_APPS)
    if base not in known:
        raise ValueError(f"unknown proxy {base!r}; known: {', '.join(known)}")
    if rest and not base.startswith("pdplane"):
        raise ValueError(f"variants are for pdplane proxies only: {name!r}")
    unknown = sorted(set(rest) - set(VARIANTS))
    if unknown:
        raise ValueError(f"unknown pdplane variant(s) {unknown} in {name!r}; known: {VARIANTS}")


def start_proxy(name: str, fleet: Fleet, cpus: str, logs: Path) -> ProxyRun:
    """Starts proxy `name` over `fleet` pinned to `cpus` and waits until it relays a request.

    Names: "pdplane" (sequential dispatch, gRPC scheduler), "pdplane-concurrent",
    "pdplane-embedded" (`--scheduler embedded`), "vllm-router", "xpyd-proxy",
    "direct" (no proxy: the first decode sim), "python-floor" / "python-floor-fastapi" (a bare
    uvicorn + aiohttp relay on the first prefill and decode sims); a pdplane name may end in
    "+variant"s (`VARIANTS`). Raises RuntimeError when it does not come up.
    """
    if name == "direct":
        return ProxyRun("direct", fleet.decode[0])
    base, *rest = name.split("+")
    variants = frozenset(rest)
    if variants and not base.startswith("pdplane"):
        raise ValueError(f"variants are for pdplane proxies only: {name!r}")
    if base in ("pdplane", "pdplane-sequential"):
        run = _pdplane(fleet, cpus, logs, "sequential", variants, name)
    elif base == "pdplane-concurrent":
        run = _pdplane(fleet, cpus, logs, "concurrent", variants, name)
    elif base == "pdplane-embedded":
        run = _pdplane_embedded(fleet, cpus, logs, variants, name)
    elif name == "vllm-router":
        run = _vllm_router(fleet, cpus, logs)
    elif name == "xpyd-proxy":
        run = _xpyd(fleet, cpus, logs)
    elif name in _FLOOR_APPS:
        run = _floor(fleet, cpus, logs, name)
    else:
        raise ValueError(f"unknown proxy {name!r}")
    try:
        wait_ready(run, fleet.model, precise=bool(fleet.tokenizer) and base.startswith("pdplane"))
    except BaseException:
        run.stop()
        raise
    return run
