"""Fuzzing the relay endpoints against a real gateway over `pdplane sim` instances.

Two generators: schemathesis from the gateway's own /openapi.json (the request bodies it
publishes, valid and not), and a hypothesis strategy of hostile JSON (any JSON values where the
gateway reads fields, deep nesting, lone surrogates, raw bytes). Every answer must be below 500,
the gateway must stay up, and its RSS must stay bounded. Bounded to a few hundred requests
(~1-2 minutes on 2 cores) so that it runs in the normal test suite.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.gateway.conftest import MODEL, Stack

_FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
#: Answers seen per generator, status -> count (printed at the end: what the fuzzing reached).
_STATUSES: dict[str, Counter[int]] = {"schema": Counter(), "hostile": Counter()}
#: Gateway RSS may grow at most this much over the whole fuzzing run (MB).
_MAX_RSS_GROWTH_MB = 200


@pytest.fixture(scope="module")
def fuzz_stack() -> Iterator[Stack]:
    from tests.integration.gateway.conftest import stack_factory as factory

    gen = factory.__wrapped__()  # type: ignore[attr-defined]
    start = next(gen)
    stack = start(embedded=True)
    sims = stack.sims(["prefill", "decode"], itl_ms=0)
    stack.wait_ready(sims)
    rss_before = psutil.Process().memory_info().rss
    yield stack
    growth = (psutil.Process().memory_info().rss - rss_before) / 2**20
    print(f"fuzzing: answers {_STATUSES}, RSS +{growth:.0f} MB")
    assert httpx.get(f"{stack.url}/health", timeout=5).status_code == 200
    assert growth < _MAX_RSS_GROWTH_MB, f"RSS grew {growth:.0f} MB while fuzzing"
    gen.close()


@pytest.fixture(scope="module")
def operations(fuzz_stack: Stack) -> list[Any]:
    """The relay endpoints' operations, from the gateway's own /openapi.json."""
    schema = schemathesis.openapi.from_url(f"{fuzz_stack.url}/openapi.json")
    return [schema[path]["POST"] for path in ("/v1/completions", "/v1/chat/completions")]


@given(data=st.data(), which=st.integers(0, 1))
@_FUZZ
def test_schema_driven_bodies_never_get_a_5xx(
    fuzz_stack: Stack, operations: list[Any], data: st.DataObject, which: int
) -> None:
    case = data.draw(operations[which].as_strategy())
    if isinstance(case.body, dict):
        if data.draw(st.booleans()):  # half the bodies name the served model, to get past 404
            case.body["model"] = MODEL
        # Keep answers short: the sims would generate every requested token.
        for name in ("max_tokens", "max_completion_tokens", "n"):
            if isinstance(case.body.get(name), int) and case.body[name] > 8:
                case.body[name] = 8
    response = case.call(base_url=fuzz_stack.url, timeout=30)
    _STATUSES["schema"][response.status_code] += 1
    assert response.status_code < 500, (case.body, response.status_code, response.text[:300])


_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
_fields = st.fixed_dictionaries(
    {},
    optional={
        "model": st.just(MODEL) | st.just(MODEL) | _json,
        "prompt": st.text(min_size=1)
        | st.lists(st.integers(0, 2**32 + 1), min_size=1, max_size=50)
        | _json,
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system"]) | _json, "content": st.text() | _json}
            ),
            min_size=1,
            max_size=3,
        )
        | _json,
        "stream": _json,
        "stream_options": _json,
        "max_tokens": st.integers(-3, 8) | _json,
        "max_completion_tokens": st.integers(-3, 8) | _json,
        "n": st.integers(-1, 2) | _json,
        "user": _json,
        "use_beam_search": _json,
        "kv_transfer_params": _json,
    },
)


def _raw(body: object, mangle: int) -> bytes:
    raw = json.dumps(body).encode()
    if mangle == 1:
        return raw[: len(raw) // 2]  # truncated JSON
    if mangle == 2:
        return raw.replace(b'"', b'"\\ud800', 1)  # a lone surrogate escape
    if mangle == 3:
        return raw.replace(b"{", b'{"x": ' + b"[" * 3000 + b"]" * 3000 + b", ", 1)
    if mangle == 4:
        return raw + b"\xed\xa0\x80"
    return raw


@given(body=_fields, mangle=st.integers(0, 6), chat=st.booleans())
@_FUZZ
def test_hostile_json_bodies_never_get_a_5xx(
    fuzz_stack: Stack, body: dict[str, Any], mangle: int, chat: bool
) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = httpx.post(
        f"{fuzz_stack.url}{path}",
        content=_raw(body, mangle),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    _STATUSES["hostile"][r.status_code] += 1
    assert r.status_code < 500, (body, mangle, r.status_code, r.text[:300])
    if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json"):
        assert "error" in r.json()
