"""The tenants file (`pdplane.gateway.tenants`) and the keys' rate limits
(`pdplane.gateway.ratelimit`)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

import pytest

from pdplane.gateway.errors import GatewayError
from pdplane.gateway.ratelimit import RateLimiter
from pdplane.gateway.tenants import ANONYMOUS, DEFAULT_TENANT, Identity, TenantBook, load_tenants

_YAML = """
tenants:
  chat: {weight: 2, priority: 0}
  batch: {priority: 10}
keys:
  - {key: sk-chat, tenant: chat, requests_per_s: 5, tokens_per_min: 6000}
  - {key: sk-batch, tenant: batch}
  - {key: sk-edge, tenant: edge, trusted_proxy: true, tokens_per_min: 100}
"""


def _bearer(key: str) -> bytes:
    return f"Bearer {key}".encode()


def test_the_three_formats_read_the_same(tmp_path: Path) -> None:
    y = tmp_path / "t.yaml"
    y.write_text(_YAML)
    config = load_tenants(y)
    j = tmp_path / "t.json"
    j.write_text(json.dumps(config.model_dump()))
    t = tmp_path / "t.toml"
    t.write_text(
        "[tenants.chat]\nweight = 2.0\npriority = 0\n[tenants.batch]\npriority = 10\n"
        '[[keys]]\nkey = "sk-chat"\ntenant = "chat"\nrequests_per_s = 5\ntokens_per_min = 6000\n'
        '[[keys]]\nkey = "sk-batch"\ntenant = "batch"\n'
        '[[keys]]\nkey = "sk-edge"\ntenant = "edge"\ntrusted_proxy = true\ntokens_per_min = 100\n'
    )
    assert load_tenants(j) == config == load_tenants(t)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("keys: [{key: a, tenant: x}, {key: a, tenant: y}]", "listed twice"),
        ("keys: [{key: a}]", "tenant"),
        ("keys: [{key: a, tenant: x, tokens_per_min: -1}]", "tokens_per_min"),
        ("nonsense: 1", "nonsense"),
        ("keys: [", "t.yaml"),
    ],
)
def test_a_bad_file_is_a_clear_error(tmp_path: Path, text: str, words: str) -> None:
    p = tmp_path / "t.yaml"
    p.write_text(text)
    with pytest.raises(ValueError, match=words):
        load_tenants(p)


def test_identify_by_key_class_and_trusted_proxy(tmp_path: Path) -> None:
    p = tmp_path / "t.yaml"
    p.write_text(_YAML)
    book = TenantBook(str(p), flag_keys=("sk-flag",))
    chat = book.identify(_bearer("sk-chat"))
    assert chat is not None and (chat.tenant, chat.weight, chat.priority) == ("chat", 2.0, 0)
    assert chat.requests_per_s == 5 and chat.bucket
    batch = book.identify(_bearer("sk-batch"))
    assert batch is not None and batch.priority == 10 and not batch.bucket
    flag = book.identify(_bearer("sk-flag"))
    assert flag is not None and flag.tenant == DEFAULT_TENANT
    assert book.identify(_bearer("nope")) is None and book.identify(None) is None
    # Only a trusted proxy's key names its tenant; each named tenant has its own bucket.
    assert book.identify(_bearer("sk-chat"), "batch").tenant == "chat"  # type: ignore[union-attr]
    a, b = book.identify(_bearer("sk-edge"), "a"), book.identify(_bearer("sk-edge"), "b")
    assert a is not None and b is not None and a.tenant == "a" and a.bucket != b.bucket
    assert TenantBook(None).identify(None) == Identity()


def test_reload_on_change_and_a_bad_file_keeps_the_previous(tmp_path: Path) -> None:
    p = tmp_path / "t.yaml"
    p.write_text(_YAML)
    results: list[str] = []
    book = TenantBook(str(p), on_reload=results.append)
    assert not book.reload_if_changed()
    p.write_text(_YAML + "  - {key: sk-new, tenant: new}\n")
    os.utime(p, ns=(1, 1))  # a change even within the file system's time resolution
    assert book.reload_if_changed()
    assert book.identify(_bearer("sk-new")) is not None
    p.write_text("keys: [")
    assert not book.reload_if_changed()
    assert book.identify(_bearer("sk-new")) is not None  # the previous configuration stays
    p.unlink()
    assert not book.reload_if_changed()
    assert results == ["ok", "error", "error"]


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("t.yaml", "tenants:\n  a: {weight: 1}\n  a: {weight: 2}\nkeys: [{key: k, tenant: a}]\n"),
        ("t.json", '{"keys": [{"key": "k", "tenant": "a"}], "keys": []}'),
    ],
)
def test_a_name_given_twice_in_a_mapping_is_refused(tmp_path: Path, name: str, text: str) -> None:
    # The parsers keep the last one silently: a `keys` given twice, the last one empty, lost
    # every key without a word.
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(ValueError, match="given twice"):
        load_tenants(p)


def test_a_tenants_key_may_ask_for_a_later_priority_never_an_earlier_one(tmp_path: Path) -> None:
    p = tmp_path / "t.yaml"
    p.write_text(_YAML)
    batch = TenantBook(str(p)).identify(_bearer("sk-batch"))  # tenant batch: priority 10
    assert batch is not None
    assert [batch.priority_of(asked) for asked in (None, -5, 0, 10, 20)] == [10, 10, 10, 10, 20]
    # Without a tenants file the field is vLLM's, as sent.
    assert [ANONYMOUS.priority_of(asked) for asked in (None, -5, 20)] == [0, -5, 20]


@pytest.mark.parametrize("emptied", ["", "keys: []\n", "tenants: {a: {weight: 2}}\n"])
def test_a_file_listing_no_key_never_opens_the_gateway(tmp_path: Path, emptied: str) -> None:
    # A tool that truncates the file before writing it can leave it empty for a moment the
    # reload poll sees: the gateway keeps requiring the keys it had.
    p = tmp_path / "t.yaml"
    p.write_text(_YAML)
    results: list[str] = []
    book = TenantBook(str(p), on_reload=results.append)
    p.write_text(emptied)
    os.utime(p, ns=(1, 1))
    assert not book.reload_if_changed()
    assert results == ["error"]
    assert book.required and book.identify(_bearer("sk-unknown")) is None
    assert book.identify(_bearer("sk-chat")) is not None
    # Given at start, such a file is refused (`pdplane gateway` / `up`: status 2).
    with pytest.raises(ValueError, match="lists no key"):
        TenantBook(str(p))


def test_tokens_per_min_429_has_the_right_retry_after_and_usage_gives_back() -> None:
    now = [0.0]
    limits = RateLimiter(clock=lambda: now[0])
    who = Identity(tenant="t", bucket="k/t", tokens_per_min=600)  # 10 tokens/s
    limits.take(who, 500)
    with pytest.raises(GatewayError) as refused:
        limits.take(who, 200)  # 100 left: 100 more come in 10 s
    assert refused.value.status == 429 and refused.value.headers["retry-after"] == "10"
    assert refused.value.type_ == "tokens" and refused.value.code == "rate_limit_exceeded"
    now[0] = 9.0
    with pytest.raises(GatewayError):
        limits.take(who, 200)
    now[0] = 10.0
    limits.take(who, 200)  # after Retry-After it passes
    limits.settle(who, 200, 50)  # used 50 of 200: 150 back
    limits.take(who, 150)
    with pytest.raises(GatewayError):
        limits.take(who, 1)


def test_requests_per_s_and_a_request_larger_than_the_bucket() -> None:
    now = [0.0]
    limits = RateLimiter(clock=lambda: now[0])
    who = Identity(tenant="t", bucket="k", requests_per_s=2, tokens_per_min=60)
    limits.take(who, 1000)  # larger than the bucket: let through when full, leaves a debt
    with pytest.raises(GatewayError) as refused:
        limits.take(who, 1)
    assert refused.value.type_ == "tokens"
    assert int(refused.value.headers["retry-after"]) == 1000 - 60 + 1
    rps = Identity(tenant="t", bucket="r", requests_per_s=2)
    limits.take(rps, 1)
    limits.take(rps, 1)
    with pytest.raises(GatewayError) as refused:
        limits.take(rps, 1)
    assert refused.value.type_ == "requests" and refused.value.headers["retry-after"] == "1"


async def test_the_file_in_force_is_logged_at_startup_and_on_each_reload(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pdplane.gateway.tenants")
    p = tmp_path / "t.yaml"
    p.write_text(_YAML)
    book = TenantBook(str(p), ("sk-flag",))
    watching = asyncio.create_task(book.watch(30.0))
    await asyncio.sleep(0)  # the watch's first step: the startup line
    assert [r.getMessage() for r in caplog.records] == [
        f"tenants file {p}: 3 tenants, 3 keys (and 1 --api-key keys); reread when it "
        "changes, checked every 30 s"
    ]
    p.write_text("keys: [{key: sk-new, tenant: new}]\n")
    os.utime(p, ns=(1, 1))  # a new stamp even within the clock's resolution
    assert book.reload_if_changed()
    assert caplog.records[-1].getMessage() == (
        f"tenants file {p}: 1 tenants, 1 keys (and 1 --api-key keys) reloaded"
    )
    watching.cancel()
