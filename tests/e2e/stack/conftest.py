"""The whole stack on the session's real vLLM pair: scheduler + gateway in-process, wired to the
session registry and the 1P1D pair of tests/e2e/conftest.py."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from pdplane.gateway.testing import running_gateway
from pdplane.launch.process import http_ok, wait_until
from tests.e2e.conftest import VllmPair
from tests.integration.scheduler.fixtures import running_scheduler

_prompt_ids = itertools.count()


def fresh_text(tag: str) -> str:
    """A prompt no other request of the run used (vLLM's prefix cache would answer a repeat
    locally and no KV would move). ~100 tokens with the tiny tokenizer."""
    n = next(_prompt_ids)
    words = " ".join(f"{tag}{n}w{i}" for i in range(40))
    return f"Request {n} about {tag}: {words}. The prefill and decode instances"


@pytest.fixture(scope="session")
def gateway_url(registry_address: str, vllm_pair: VllmPair) -> Iterator[str]:
    """Gateway URL (no /v1) in front of the session's pair, ready to serve."""
    with (
        running_scheduler(registry_address) as scheduler,
        running_gateway(scheduler, registry_address) as url,
    ):
        wait_until(lambda: http_ok(f"{url}/health"), 60.0, what="gateway /health 200")
        yield url
