"""In-process sims for tests: `running_sims(...)` (any test) and `async_running_sims(...)`;
`expected_text(...)`, what a sim answers to a text prompt.

Example::

    with running_sims(["prefill", "decode"], itl_ms=1) as sims:
        p, d = sims.urls
        ...
        assert sims[1].records()[0]["body"]["kv_transfer_params"]["do_remote_prefill"]
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from pdplane.sim.config import SimConfig, SimRole
from pdplane.sim.instance import SimInstance
from pdplane.sim.sim_fleet import SimFleet
from pdplane.sim.tokens import WordTokenizer, generate, prompt_key

__all__ = ["RunningSims", "async_running_sims", "expected_text", "running_sims"]

_START_TIMEOUT_S = 30.0


def expected_text(prompt: str, seed: int, num_tokens: int) -> str:
    """The text of the first `num_tokens` tokens a sim (default tokenizer) answers to the
    completions prompt `prompt` with `seed`."""
    return "".join(generate(prompt_key(WordTokenizer().encode(prompt)), seed, num_tokens))


class SimHandle:
    """A started sim as a test sees it: addresses plus what it received."""

    def __init__(self, instance: SimInstance) -> None:
        self.instance = instance

    @property
    def url(self) -> str:
        return self.instance.url

    @property
    def kv_endpoint(self) -> str:
        return self.instance.kv_endpoint

    @property
    def instance_id(self) -> str:
        return self.instance.instance_id

    @property
    def role(self) -> str:
        return self.instance.config.role

    def records(self) -> list[dict[str, Any]]:
        """Received requests, oldest first (same dicts as `GET /sim/requests`)."""
        return [r.to_dict() for r in self.instance.state.recorder.records()]

    def held_transfers(self) -> list[str]:
        """Transfer ids whose KV this (prefill) sim still holds."""
        return list(self.instance.state.transfers.held)

    def freed_transfers(self) -> list[dict[str, Any]]:
        """How finished transfers ended: dicts with transfer_id, request_id, reason."""
        return list(self.instance.state.transfers.freed)

    def set_faults(self, **changes: Any) -> None:
        """Changes fault injection (fields of `POST /sim/faults`). Raises ValueError."""
        self.instance.state.faults.update(changes)


class RunningSims:
    """The sims of one `running_sims` block, in the order of the roles given."""

    def __init__(self, fleet: SimFleet) -> None:
        self.handles = [SimHandle(i) for i in fleet.instances]

    def __getitem__(self, index: int) -> SimHandle:
        return self.handles[index]

    def __len__(self) -> int:
        return len(self.handles)

    @property
    def urls(self) -> list[str]:
        return [h.url for h in self.handles]

    def by_role(self, role: SimRole) -> list[SimHandle]:
        return [h for h in self.handles if h.role == role]


def _configs(
    roles: Sequence[str] | str, configs: Sequence[SimConfig] | None, knobs: dict[str, Any]
) -> list[SimConfig]:
    if configs is not None:
        return list(configs)
    role_list = [roles] if isinstance(roles, str) else list(roles)
    profile = knobs.pop("profile", "")
    base = SimConfig.from_profile(profile, **knobs) if profile else SimConfig(**knobs)
    # SimConfig validates each role (ValueError names a bad one).
    return [
        dataclasses.replace(base, role=r, labels=dict(base.labels))  # type: ignore[arg-type]
        for r in role_list
    ]


@asynccontextmanager
async def async_running_sims(
    roles: Sequence[str] | str = ("prefill", "decode"),
    *,
    configs: Sequence[SimConfig] | None = None,
    registry: str | None = None,
    registry_token: str | None = None,
    lease_ttl_ms: int = 0,
    **knobs: Any,
) -> AsyncIterator[RunningSims]:
    """Sims on the current event loop; `knobs` are SimConfig fields shared by all of them."""
    fleet = SimFleet(
        _configs(roles, configs, knobs),
        registry=registry,
        registry_token=registry_token,
        lease_ttl_ms=lease_ttl_ms,
    )
    await fleet.start()
    try:
        yield RunningSims(fleet)
    finally:
        await fleet.stop()


@contextmanager
def running_sims(
    roles: Sequence[str] | str = ("prefill", "decode"),
    *,
    configs: Sequence[SimConfig] | None = None,
    registry: str | None = None,
    registry_token: str | None = None,
    lease_ttl_ms: int = 0,
    **knobs: Any,
) -> Iterator[RunningSims]:
    """Sims on their own event loop in a background thread; usable from sync and async tests.

    Yields once every sim serves HTTP (and gRPC); stops them all and joins the thread on exit.
    Raises whatever a sim's start raised (e.g. OSError for a busy port).
    """
    fleet = SimFleet(
        _configs(roles, configs, knobs),
        registry=registry,
        registry_token=registry_token,
        lease_ttl_ms=lease_ttl_ms,
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="pdplane-sims", daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(fleet.start(), loop).result(_START_TIMEOUT_S)
        try:
            yield RunningSims(fleet)
        finally:
            asyncio.run_coroutine_threadsafe(fleet.stop(), loop).result(_START_TIMEOUT_S)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=_START_TIMEOUT_S)
        loop.close()
