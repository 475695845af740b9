"""The real stack on loopback: registry, scheduler, gateway, and engine simulators as instances.

`stack` starts a registry (short lease), a scheduler watching it and a gateway using both; each
test starts the sims it needs with `stack.sims(...)` (they register themselves and heartbeat).
`stack` runs every test twice: with the remote scheduler process and with the scheduler
embedded in the gateway (`--scheduler embedded`); `stack_factory(embedded=True)` picks one.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from pdplane.core import tracing
from pdplane.gateway.testing import running_gateway_app
from pdplane.scheduler.decision import Decider
from pdplane.scheduler.kv_index import KvIndexManager
from pdplane.scheduler.local import LocalScheduler
from pdplane.scheduler.server import SchedulerServer
from pdplane.sim.testing import RunningSims, running_sims
from tests.integration.registry.fixtures import running_registry
from tests.integration.scheduler.fixtures import running_scheduler_server
from tests.support.otlp import OtlpReceiver, otlp_receiver

MODEL = "sim-model"


def wait_for(condition: Callable[[], bool], timeout: float = 5.0, what: str = "") -> None:
    """Polls `condition` every 10 ms; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what or condition}")
        time.sleep(0.01)


class Stack:
    """Addresses of the running services plus helpers to start sims and read state.

    `scheduler` is the remote scheduler process (None when the gateway embeds it); `service` is
    the `Decider` deciding for the gateway either way.
    """

    def __init__(
        self,
        registry: str,
        scheduler: SchedulerServer | None,
        gateway: str,
        service: Decider,
    ) -> None:
        self.registry = registry
        self.scheduler = scheduler
        self.url = gateway
        self.service = service
        self._exits = contextlib.ExitStack()
        #: the gateway's FastAPI app (its `state.relay` for what it holds); set by the factory
        self.app: Any = None

    def sims(self, roles: list[str], model: str = MODEL, **knobs: Any) -> RunningSims:
        """Starts registered sims of `model` (kept until the test ends); `knobs` are SimConfig
        fields."""
        sims = self._exits.enter_context(
            running_sims(roles, registry=self.registry, model=model, **knobs)  # type: ignore[arg-type]
        )
        return sims

    def health(self, model: str | None = None) -> httpx.Response:
        """GET /health, or /health?model=`model` (per-model readiness)."""
        params = {} if model is None else {"model": model}
        return httpx.get(f"{self.url}/health", params=params, timeout=5)

    def wait_ready(self, sims: RunningSims) -> None:
        """Waits until the gateway is healthy and the scheduler sees every sim of `sims`."""
        wait_for(lambda: self.health().status_code == 200, 10, "gateway /health 200")
        ids = {h.instance_id for h in sims.handles}
        view = self.service.view
        wait_for(
            lambda: ids <= {c.instance_id for c in view.candidates(MODEL)},
            10,
            "the scheduler to see the sims",
        )

    def kv_index(self) -> KvIndexManager:
        """The prefix index the deciding scheduler reads (remote process or embedded)."""
        if self.scheduler is not None:
            manager = self.scheduler.app.kv_index
        else:
            manager = self.app.state.scheduler.kv_index
        assert manager is not None, "the scheduler runs without a prefix index"
        return manager

    def scheduler_inflight(self) -> int:
        return len(self.service.inflight)

    def releases(self) -> dict[str, float]:
        """The scheduler's Release count by outcome (outcomes never released left out)."""
        out: dict[str, float] = {}
        assert self.service.metrics is not None
        for metric in self.service.metrics.registry.collect():
            if metric.name == "pdplane_scheduler_releases":
                for sample in metric.samples:
                    if sample.name.endswith("_total") and sample.value:
                        out[sample.labels["outcome"]] = sample.value
        return out

    def upstream_in_use(self) -> int:
        """The gateway's upstream connections acquired now (aiohttp keeps no public count)."""
        session = self.app.state.relay.upstream._session
        return 0 if session is None else len(session.connector._acquired)

    def background_tasks(self) -> int:
        """The gateway's background calls (AbortTransfer) still running."""
        return len(self.app.state.relay.caretaker._background)

    def close(self) -> None:
        self._exits.close()


@pytest.fixture
def stack_factory() -> Iterator[Callable[..., Stack]]:
    """Starts a Stack; `embedded=True` embeds the scheduler in the gateway (no scheduler
    process); other keywords are GatewaySettings fields."""
    exits = contextlib.ExitStack()

    def start(*, embedded: bool = False, **gateway_settings: Any) -> Stack:
        registry = exits.enter_context(
            running_registry(lease_ttl_ms=2000, heartbeat_interval_ms=200)
        )
        scheduler = None
        if embedded:
            address = "embedded"
        else:
            scheduler = exits.enter_context(running_scheduler_server(registry))
            address = scheduler.address
        url, app = exits.enter_context(
            running_gateway_app(address, registry, registry_wait_s=5.0, **gateway_settings)
        )
        if scheduler is None:
            port = app.state.scheduler
            assert isinstance(port, LocalScheduler)
            service = port.service
        else:
            assert scheduler.app.service is not None
            service = scheduler.app.service
        stack = Stack(registry, scheduler, url, service)
        stack.app = app
        exits.callback(stack.close)  # sims stop first (LIFO)
        return stack

    with exits:
        yield start


@pytest.fixture(params=["remote", "embedded"])
def stack(request: pytest.FixtureRequest, stack_factory: Callable[..., Stack]) -> Stack:
    """A Stack with the remote scheduler, then with the scheduler embedded in the gateway."""
    return stack_factory(embedded=request.param == "embedded")


@pytest.fixture
def pair(stack: Stack) -> tuple[Stack, RunningSims]:
    """The stack with one prefill and one decode sim, healthy."""
    sims = stack.sims(["prefill", "decode"], itl_ms=1)
    stack.wait_ready(sims)
    return stack, sims


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    """An OTLP receiver on loopback that this process's tracing exports to for the test
    (tracing configured afresh, shut down after)."""
    with otlp_receiver() as r:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", r.endpoint)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "pdplane-test")
        tracing.shutdown()
        assert tracing.configure("unused")
        try:
            yield r
        finally:
            tracing.shutdown()
