"""Several sims in one process and one event loop (`pdplane sim --instances K`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pdplane.sim.config import SimConfig
from pdplane.sim.instance import SimInstance
from pdplane.sim.tokens import Tokenizer, load_tokenizer

__all__ = ["SimFleet", "expand"]


def expand(config: SimConfig, count: int) -> list[SimConfig]:
    """`count` copies of `config` on consecutive ports (port 0 stays "any free port")."""

    def nth(base: int, i: int) -> int:
        return base + i if base else 0

    return [
        dataclasses.replace(
            config,
            port=nth(config.port, i),
            kv_port=nth(config.kv_port, i),
            instance_id=f"{config.instance_id}-{i}"
            if config.instance_id and count > 1
            else config.instance_id,
            seed=config.seed,
            labels=dict(config.labels),
        )
        for i in range(count)
    ]


class SimFleet:
    """Starts and stops a list of sims together; a failed start stops those already up.

    Sims naming the same tokenizer share one loaded copy.
    """

    def __init__(
        self,
        configs: Sequence[SimConfig],
        *,
        registry: str | None = None,
        registry_token: str | None = None,
        lease_ttl_ms: int = 0,
    ) -> None:
        tokenizers: dict[str, Tokenizer] = {}
        for c in configs:
            if c.tokenizer not in tokenizers:
                tokenizers[c.tokenizer] = load_tokenizer(c.tokenizer or None)
        self.instances = [
            SimInstance(
                c,
                registry=registry,
                registry_token=registry_token,
                lease_ttl_ms=lease_ttl_ms,
                tokenizer=tokenizers[c.tokenizer],
            )
            for c in configs
        ]

    @property
    def urls(self) -> list[str]:
        return [i.url for i in self.instances]

    async def start(self) -> None:
        started: list[SimInstance] = []
        try:
            for instance in self.instances:
                await instance.start()
                started.append(instance)
        except BaseException:
            for instance in reversed(started):
                await instance.stop()
            raise

    async def stop(self) -> None:
        for instance in reversed(self.instances):
            await instance.stop()
