"""The scheduler app keeps a prefix index fed by the instances of its view."""

from __future__ import annotations

import random

from pdplane.core.prefix_hash import block_hashes
from pdplane.scheduler.app import SchedulerApp
from pdplane.scheduler.settings import SchedulerSettings
from pdplane.scheduler.view import StaticSource
from tests.integration.kv_events.helpers import BS, TOKEN, Engine


async def test_scheduler_app_index_follows_its_view() -> None:
    engine = Engine("p0")
    try:
        rng = random.Random(0)
        prompt = [rng.randrange(50_000) for _ in range(3 * BS)]
        engine.store(prompt)
        settings = SchedulerSettings(registry="127.0.0.1:1", port=0, token=TOKEN)
        app = SchedulerApp(settings, source=StaticSource(engine.instance()))
        await app.start()
        try:
            assert app.kv_index is not None and app.service is not None
            assert app.service.kv_index is app.kv_index.index
            assert app.kv_index.wait_live(10)
            assert app.service.kv_index.match(block_hashes(prompt, BS)) == {"p0": 3}
        finally:
            await app.stop()
        assert app.kv_index is None
    finally:
        engine.stop()


async def test_no_kv_index_flag() -> None:
    settings = SchedulerSettings(registry="127.0.0.1:1", port=0, kv_index=False)
    app = SchedulerApp(settings, source=StaticSource())
    await app.start()
    try:
        assert app.kv_index is None and app.service is not None and app.service.kv_index is None
    finally:
        await app.stop()
