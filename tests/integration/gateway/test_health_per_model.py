"""Must show: a two-model gateway whose second model loses its only prefill stays ready (and
serving) for the first; per-model readiness answers for each model alone."""

from __future__ import annotations

import httpx
import pytest

from pdplane.sim.testing import running_sims
from tests.integration.gateway.conftest import MODEL, Stack, wait_for

OTHER = "other-model"


def _complete(stack: Stack, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "hello there", "max_tokens": 3}
    return httpx.post(f"{stack.url}/v1/completions", json=body, timeout=10)


@pytest.mark.parametrize("embedded", [False, True], ids=["remote", "embedded"])
def test_a_model_that_loses_its_prefill_leaves_the_gateway_ready_for_the_other(
    stack_factory, embedded: bool
) -> None:  # type: ignore[no-untyped-def]
    # The model without a prefill waits for one (--queue-timeout-s), then 503.
    stack: Stack = stack_factory(embedded=embedded, queue_timeout_s=0.5)
    first = stack.sims(["prefill", "decode"], itl_ms=1)
    stack.wait_ready(first)
    stack.sims(["decode"], model=OTHER, itl_ms=1)
    with running_sims(["prefill"], registry=stack.registry, model=OTHER, itl_ms=1):
        wait_for(lambda: stack.health(OTHER).status_code == 200, 10, f"{OTHER} servable")
        assert stack.health().json()["status"] == "ok"
    # The other model's only prefill is gone (it deregistered on the way out).
    wait_for(lambda: stack.health(OTHER).status_code == 503, 10, f"{OTHER} not servable")

    r = stack.health()
    assert r.status_code == 200, r.text  # the gateway stays ready: MODEL still serves
    body = r.json()
    assert body["status"] == "degraded"
    assert body["reason"] == f"model '{OTHER}': no prefill instance"
    assert body["models"][MODEL]["paired"] is True and body["models"][OTHER]["paired"] is False

    r = stack.health(MODEL)
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["model"] == MODEL
    assert list(r.json()["models"]) == [MODEL]
    r = stack.health(OTHER)
    assert r.status_code == 503 and r.json()["reason"] == f"model '{OTHER}': no prefill instance"
    r = stack.health("no-such-model")
    assert r.status_code == 503
    assert r.json()["reason"] == "model 'no-such-model': no instance registered"

    assert _complete(stack, MODEL).status_code == 200  # traffic for MODEL is served
    assert _complete(stack, OTHER).status_code == 503
