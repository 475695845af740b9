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
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc
import httpx

from pdplane.gateway.testing import running_gateway_app
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
    failed: list[str] = field(default_factory=list)  # what the failed ones answered
    seconds: float = 0.0  # burst start -> every request streaming

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
    sets `started` at the first token. Raises httpx errors (refused, 5xx) as they come."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()

        async def read() -> None:
            async for line in resp.aiter_lines():
                if started is not None and line.startswith("data: {"):
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
    failed: list[str],
    dead: set[str],
) -> None:
    """One client request: through gateway `first`, or (refused before streaming) the next."""
    for k in range(len(urls)):
        url = urls[(first + k) % len(urls)]
        if url in dead:
            continue
        ev = asyncio.Event()
        try:
            task = asyncio.create_task(_hold_stream(client, url, ev, release))
            waiter = asyncio.create_task(ev.wait())
            done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if waiter in done:
                started.append(time.monotonic())
                await task
                return
            waiter.cancel()
            await task  # raises: it ended before streaming
            failed.append(f"{url}: ended before streaming")
            return
        except (httpx.TransportError, httpx.HTTPStatusError) as exc:
            if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code < 500:
                failed.append(f"{url}: HTTP {exc.response.status_code}")
                return
            continue  # refused before streaming: a load balancer tries the next gateway
    failed.append("every gateway refused")


async def _drive(
    sims: RunningSims, urls: list[str], pre: int, burst: int, kill: Any
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
        await asyncio.to_thread(kill.wait_pre_visible)
        started: list[float] = []
        failed: list[str] = []
        dead: set[str] = set()
        t0 = time.monotonic()
        tasks = [
            asyncio.create_task(
                _burst_one(client, urls, i % len(urls), release, started, failed, dead)
            )
            for i in range(burst)
        ]
        if kill.target is not None:
            while len(started) < burst // 3:
                await asyncio.sleep(0.005)
            await asyncio.to_thread(kill.now)
            dead.add(urls[0]) if kill.target == "gateway" else None
        while len(started) + len(failed) < burst:
            await asyncio.sleep(0.01)
        seconds = time.monotonic() - t0
        release.set()
        for t in [*holders, *tasks]:
            t.cancel()
        await asyncio.gather(*holders, *tasks, return_exceptions=True)
    return started, failed, seconds


class _Killer:
    def __init__(self, target: Literal["scheduler", "gateway"] | None) -> None:
        self.target = target
        self.kill: Any = None
        self.wait_pre_visible: Any = None

    def now(self) -> None:
        self.kill()


def run(
    *,
    mode: Literal["remote", "embedded", "shared"] = "remote",
    replicas: int = 2,
    decode_policy: str = "least_loaded",
    share: bool = True,
    pre: int = 40,
    burst: int = 120,
    heartbeat_ms: int = 1000,
    kill: Literal["scheduler", "gateway"] | None = None,
) -> Result:
    """One run of the scenario (module docstring). `mode`: "remote" = one scheduler process per
    gateway, "embedded" = gateways deciding themselves, "shared" = one scheduler behind every
    gateway (the single-scheduler reference). `share` turns the in-flight exchange between the
    replicas on or off."""
    killer = _Killer(kill)
    with _fleet(heartbeat_ms) as (registry, sims), contextlib.ExitStack() as stack:
        decode_ids = [h.instance_id for h in sims.by_role("decode")]
        policy: dict[str, Any] = {"prefill_policy": "least_loaded", "decode_policy": decode_policy}
        schedulers: list[SchedulerServer] = []
        if mode in ("remote", "shared"):
            for _ in range(1 if mode == "shared" else replicas):
                server = SchedulerServer(
                    SchedulerSettings.model_validate(
                        {"registry": registry, "host": "127.0.0.1", "port": 0, **policy}
                        | {"seed": len(schedulers)}
                    )
                )
                server.start()
                stack.callback(server.stop, 0.2)
                schedulers.append(server)
        apps = []
        urls = []
        for i in range(replicas):
            extra: dict[str, Any]
            if mode == "embedded":
                target, extra = "embedded", {**policy, "seed": i}
            else:
                target, extra = schedulers[0 if mode == "shared" else i].address, {}
            url, app = stack.enter_context(
                running_gateway_app(target, registry, max_retries=1, **extra)
            )
            urls.append(url)
            apps.append(app)

        def visible() -> bool:
            got = _instances(registry)
            return all(got[d].load.num_running == pre for d in decode_ids[1:])

        killer.wait_pre_visible = lambda: _wait(visible, 30, "pre-existing streams visible")
        killer.kill = schedulers[0].stop if kill == "scheduler" else None
        started, failed, seconds = asyncio.run(_drive(sims, urls, pre, burst, killer))
        counts = [
            sum(1 for r in h.records() if r["body"].get("kv_transfer_params"))
            for h in sims.by_role("decode")
        ]
    totals = [c + (pre if i else 0) for i, c in enumerate(counts)]
    return Result(counts, totals, len(started), failed, seconds)
