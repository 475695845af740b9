"""The whole stack on the session's real vLLM pair: scheduler + gateway in-process, wired to the
session registry and the 1P1D pair of tests/e2e/conftest.py."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

# Imported here, once, before any fixture starts a gateway: a gateway loading the fleet's
# tokenizer on its own thread while a fixture's first `from transformers import ...` runs
# can see transformers' lazy module half made ("cannot import name 'AutoTokenizer'").
from transformers import AutoTokenizer

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


@pytest.fixture(scope="module")
def whole_tokens(tiny_model: Path) -> list[int]:
    """Ids of the tiny tokenizer's tokens that are text of their own. The tiny model samples
    ids its tokenizer lacks (its vocabulary is padded) and byte tokens that are part of a
    character: their text is "", and such a first token takes the usual path (see
    `FirstToken.of`). Tests of the prefill path sample only these (`allowed_token_ids`)."""
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    special = set(tok.all_special_ids)
    out = []
    for i in range(len(tok)):
        text = tok.decode([i])
        if i not in special and text and "\ufffd" not in text:
            out.append(i)
    return out
