"""The replicas scenario: several schedulers (or embedded-mode gateways) over one fleet.

2 prefill + 4 simulated decode instances register with one registry; decodes 1-3 already run
`pre` long streams each (sent to them directly, so the schedulers know them only from the
heartbeats); then a burst of `burst` long streaming requests is split evenly across the
gateways. Returns where the burst landed and the total decode load (pre + burst) max/mean.
With `kill`, one replica (its scheduler in remote mode, its gateway in embedded mode) is
stopped once a third of the burst has started, and requests it refused before streaming are
sent to another gateway (what a load balancer in front of them does).

Everything runs in this process on loopback: registry, sims, schedulers and gateways on their
own threads, the clients on one asyncio loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdplane.gateway.testing import running_gateway_app
from pdplane.launch.ports import free_port_run
from pdplane.launch.process import ManagedProcess, grpc_serving, http_ok, wait_until
from pdplane.registry.server import RegistryServer
from pdplane.registry.settings import RegistrySettings
from pdplane.scheduler.server import SchedulerServer
from pdplane.scheduler.settings import SchedulerSettings
from pdplane.sim.testing import RunningSims, running_sims
from pdplane.v1 import registry_pb2, registry_pb2_grpc

__all__ = ["Result", "run"]

MODEL = "sim-model"
PROMPT = "word " * 60
MAX_TOKENS = 1000
ITL_MS = 500.0  # streams outlive the run; they are closed at the end


@dataclass
class Result:
    """Burst requests per decode (decode-0 first), totals with the pre-existing streams."""

    burst: list[int]
    totals: list[int]
    started: int  # burst requests that got their first token
    failed: list[str] = field(default_factory=list)  # why the failed ones failed
    seconds: float = 0.0  # burst start -> every request streaming
    cut: int = 0  # streams broken by the death of the gateway relaying them
    killed_at: int = -1  # burst requests streaming when a replica was killed (-1: none)

    @property
    def max_over_mean(self) -> float:
        return max(self.totals) / (sum(self.totals) / len(self.totals))


def _instances(registry: str) -> dict[str, Any]:
    with grpc.insecure_channel(registry) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        reply = stub.ListInstances(registry_pb2.ListInstancesRequest(), timeout=5)
    return {i.spec.instance_id: i for i in reply.instances}


def _wait(probe: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout} s")
        time.sleep(0.02)


@contextlib.contextmanager
def _fleet(heartbeat_ms: int) -> Iterator[tuple[str, RunningSims]]:
    registry = RegistryServer(
        RegistrySettings.model_validate(
            {"host": "127.0.0.1", "port": 0, "heartbeat_interval_ms": heartbeat_ms}
        )
    )
    registry.start()
    try:
        roles = ["prefill", "prefill", "decode", "decode", "decode", "decode"]
        with running_sims(
            roles, registry=registry.address, itl_ms=ITL_MS, ttft_per_token_ms=0.2, model=MODEL
        ) as sims:
            ids = {h.instance_id for h in sims.handles}
            _wait(lambda: set(_instances(registry.address)) >= ids, 15, "sims registered")
            yield registry.address, sims
    finally:
        registry.stop(grace=0.2)


async def _hold_stream(
    client: httpx.AsyncClient, url: str, started: asyncio.Event | None, release: asyncio.Event
) -> None:
    """Streams one long completion from `url`, reading every chunk, until `release` is set;
    sets `started` at the second token, when decode is streaming it: with the first token from
    prefill (the gateway's default) the first one comes before decode has the request, which
    the run's count of where the burst landed would miss. Raises httpx errors (refused, 5xx)
    as they come."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()

        async def read() -> None:
            tokens = 0
            async for line in resp.aiter_lines():
                if started is not None and line.startswith("data: {"):
                    tokens += 1
                    if tokens == 2:
                        started.set()

        reader = asyncio.create_task(read())
        releaser = asyncio.create_task(release.wait())
        done, _ = await asyncio.wait({reader, releaser}, return_when=asyncio.FIRST_COMPLETED)
        for t in (reader, releaser):
            t.cancel()
        await asyncio.gather(reader, releaser, return_exceptions=True)
        if reader in done:
            reader.result()  # the stream ended or broke before the release
            if release.is_set():
                return
            raise httpx.RemoteProtocolError("stream ended before the run did")


async def _burst_one(
    client: httpx.AsyncClient,
    urls: list[str],
    first: int,
    release: asyncio.Event,
    started: list[float],
    dead: set[str],
) -> str:
    """One client request through gateway `first`; refused before streaming, the next one
    (what a load balancer does). Returns "started", "cut" (its stream broke: the gateway
    relaying it died) or why it failed."""
    why = "every gateway refused"
    for k in range(len(urls)):
        url = urls[(first + k) % len(urls)]
        if url in dead:
            continue
        ev = asyncio.Event()
        task = asyncio.create_task(_hold_stream(client, url, ev, release))
        waiter = asyncio.create_task(ev.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if ev.is_set():
            started.append(time.monotonic())
            try:
                await task
            except (httpx.TransportError, httpx.HTTPStatusError):
                return "cut"
            return "started"
        try:
            await task
            return f"{url}: ended before streaming"
        except httpx.HTTPStatusError as exc:
            why = f"{url}: HTTP {exc.response.status_code} {exc.response.text[:200]}"
            if exc.response.status_code < 500:
                return why
        except httpx.TransportError as exc:
            why = f"{url}: {type(exc).__name__}"
    return why


async def _drive(
    sims: RunningSims, urls: list[str], pre: int, burst: int, killer: _Killer
) -> tuple[list[float], list[str], float]:
    decodes = sims.by_role("decode")
    release = asyncio.Event()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as client:
        holders = [
            asyncio.create_task(_hold_stream(client, d.url, None, release))
            for d in decodes[1:]
            for _ in range(pre)
        ]
        await asyncio.to_thread(killer.wait_pre_visible)
        started: list[float] = []
        dead: set[str] = set()
        t0 = time.monotonic()
        tasks = [
            asyncio.create_task(_burst_one(client, urls, i % len(urls), release, started, dead))
            for i in range(burst)
        ]
        if killer.kill is not None:
            while len(started) < burst // 3:
                await asyncio.sleep(0.005)
            killer.at = len(started)
            await asyncio.to_thread(killer.kill)
            if killer.gateway:
                dead.add(urls[0])
        while len(started) < burst and not all(t.done() for t in tasks):
            await asyncio.sleep(0.01)
        seconds = time.monotonic() - t0
        release.set()
        outcomes = await asyncio.gather(*tasks)
        for t in holders:
            t.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
    return started, list(outcomes), seconds


@dataclass
class _Killer:
    wait_pre_visible: Any = None
    kill: Any = None  # what stops one replica, or None
    gateway: bool = False  # the killed replica is gateway 0 (its URL is dead)
    at: int = -1  # burst requests streaming at the kill


def _pdplane(stack: contextlib.ExitStack, logs: Path, name: str, args: list[str]) -> ManagedProcess:
    """`pdplane ARGS` as a child process, stopped when `stack` closes."""
    binary = Path(sys.executable).with_name("pdplane")
    proc = ManagedProcess(name, [str(binary), *args], logs / f"{name}.log")
    proc.start()
    stack.callback(proc.stop, 5.0)
    return proc


def run(
    *,
    mode: Literal["remote", "embedded", "shared"] = "remote",
    replicas: int = 2,
    policy: str | None = None,
    share: bool = True,
    pre: int = 40,
    burst: int = 120,
    heartbeat_ms: int = 1000,
    kill: Literal["scheduler", "gateway"] | None = None,
) -> Result:
    """One run of the scenario (module docstring). `mode`: "remote" = one scheduler per gateway
    (each gateway also knows the other schedulers' addresses, in order: its own first),
    "embedded" = gateways deciding themselves, "shared" = one scheduler behind every gateway
    (the single-scheduler reference). `share` turns the in-flight exchange between the replicas
    on or off; `policy` names both sides' policy (None: the default). With `kill`, the replicas
    run as `pdplane` processes and the first is killed (SIGKILL) mid-burst: its scheduler
    (remote) or its gateway (embedded)."""
    killer = _Killer()
    # None: the schedulers' defaults (what a deployment gets without policy flags).
    flags = ["--prefill-policy", policy, "--decode-policy", policy] if policy else []
    with (
        _fleet(heartbeat_ms) as (registry, sims),
        contextlib.ExitStack() as stack,
        tempfile.TemporaryDirectory(prefix="pdplane-replicas-") as tmp,
    ):
        logs = Path(tmp)
        decode_ids = [h.instance_id for h in sims.by_role("decode")]
        n = 1 if mode == "shared" else replicas
        ports = [free_port_run() for _ in range(n)]
        grpc_ports = [free_port_run() for _ in range(n)]
        metrics_ports = [free_port_run() for _ in range(n)]
        procs: list[ManagedProcess] = []
        urls: list[str] = []
        metrics_urls: list[str] = []

        def peers_of(i: int, of: list[int]) -> list[str]:
            return [f"127.0.0.1:{p}" for j, p in enumerate(of) if j != i] if share else []

        if mode == "embedded":
            for i in range(n):
                args = [
                    "gateway", "--scheduler", "embedded", "--registry", registry,
                    "--host", "127.0.0.1", "--port", str(ports[i]), "--seed", str(i),
                    "--replica-id", f"gateway-{i}", "--inflight-port", str(grpc_ports[i]),
                    "--peers", ",".join(peers_of(i, grpc_ports)), *flags,
                ]  # fmt: skip
                if kill:
                    procs.append(_pdplane(stack, logs, f"gateway-{i}", args))
                else:
                    url, _app = stack.enter_context(
                        running_gateway_app("embedded", registry, **_gateway_fields(args[5:]))
                    )
                    urls.append(url)
            if kill:
                urls = [f"http://127.0.0.1:{p}" for p in ports]
            metrics_urls = [f"{u}/metrics" for u in urls]
            if kill:
                for url in urls:
                    wait_until(
                        functools.partial(http_ok, f"{url}/health"), 30, watch=procs, what=url
                    )
                killer.kill, killer.gateway = procs[0].kill, True
        else:
            addresses = [f"127.0.0.1:{p}" for p in grpc_ports]
            for i in range(n):
                args = [
                    "scheduler", "--registry", registry, "--host", "127.0.0.1",
                    "--port", str(grpc_ports[i]), "--seed", str(i), "--replica-id",
                    f"scheduler-{i}", "--peers", ",".join(peers_of(i, grpc_ports)),
                    "--metrics-port", str(metrics_ports[i]), *flags,
                ]  # fmt: skip
                metrics_urls.append(f"http://127.0.0.1:{metrics_ports[i]}/metrics")
                if kill:
                    procs.append(_pdplane(stack, logs, f"scheduler-{i}", args))
                else:
                    server = SchedulerServer(
                        SchedulerSettings.model_validate(
                            {"registry": registry, **_scheduler_fields(args[1:])}
                        )
                    )
                    server.start()
                    stack.callback(server.stop, 0.2)
            for address in addresses:
                wait_until(functools.partial(grpc_serving, address), 30, watch=procs, what=address)
            for i in range(replicas):
                # Its own scheduler first, then the others (gRPC fails over in this order).
                mine = addresses[0 if mode == "shared" else i]
                order = [mine, *(a for a in addresses if a != mine)]
                target = order[0] if len(order) == 1 else "ipv4:" + ",".join(order)
                url, _app = stack.enter_context(running_gateway_app(target, registry))
                urls.append(url)
            if kill:
                killer.kill = procs[0].kill
        if share and n > 1:
            _wait(
                lambda: all(_peers_metric(u) == n - 1 for u in metrics_urls),
                15,
                "replicas following each other",
            )

        def visible() -> bool:
            got = _instances(registry)
            return all(got[d].load.num_running == pre for d in decode_ids[1:])

        killer.wait_pre_visible = lambda: _wait(visible, 30, "pre-existing streams visible")
        _started, outcomes, seconds = asyncio.run(_drive(sims, urls, pre, burst, killer))
        counts = [
            sum(1 for r in h.records() if r["body"].get("kv_transfer_params"))
            for h in sims.by_role("decode")
        ]
    totals = [c + (pre if i else 0) for i, c in enumerate(counts)]
    failed = [o for o in outcomes if o not in ("started", "cut")]
    return Result(
        counts, totals, outcomes.count("started"), failed, seconds, outcomes.count("cut"), killer.at
    )


def _flag_fields(args: list[str]) -> dict[str, Any]:
    """["--kebab-flag", "v", ...] -> {"kebab_flag": "v"} (settings fields by name)."""
    return {
        args[i].removeprefix("--").replace("-", "_"): args[i + 1] for i in range(0, len(args), 2)
    }


def _scheduler_fields(args: list[str]) -> dict[str, Any]:
    return _flag_fields(args)


def _gateway_fields(args: list[str]) -> dict[str, Any]:
    fields = _flag_fields(args)
    fields.pop("host", None)
    fields.pop("port", None)
    return fields


def _peers_metric(url: str) -> int:
    """`pdplane_scheduler_peers` from a Prometheus endpoint (-1 when unreachable)."""
    try:
        text = httpx.get(url, timeout=2.0).text
    except httpx.HTTPError:
        return -1
    for family in text_string_to_metric_families(text):
        if family.name == "pdplane_scheduler_peers":
            return int(sum(sample.value for sample in family.samples))
    return -1
