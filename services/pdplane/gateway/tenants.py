"""Who is asking: tenants, their API keys and limits, from a file reloaded while serving.

`--tenants FILE` (YAML `.yaml`/`.yml`, TOML `.toml` or JSON `.json`, parsed by PyYAML,
tomllib or pydantic, validated by the pydantic models below)::

    tenant_header: x-pdplane-tenant      # read only on keys with trusted_proxy: true
    tenants:                             # optional; a tenant not listed: weight 1, priority 0
      chat: {weight: 2, priority: 0}
      batch: {weight: 1, priority: 10}
    keys:
      - {key: sk-chat-1, tenant: chat, requests_per_s: 20, tokens_per_min: 200000}
      - {key: sk-batch, tenant: batch, tokens_per_min: 1000000}
      - {key: sk-edge, tenant: edge, trusted_proxy: true}

A tenant's `weight` is its share of the fleet against the other tenants of its priority
(`pdplane.gateway.flow`: fair by tokens); `priority` is its requests' priority when they
carry none (vLLM's meaning: lower is served first; default 0). A key's limits are its
requests per second and tokens per minute (`pdplane.gateway.ratelimit`); a trusted front
proxy's key names the tenant in `tenant_header`, and its limits then apply to each tenant it
names. Keys of `--api-key` belong to tenant "default" without limits, as does every request
when the gateway requires no key.

The file is read again when it changes (its modification time, size or inode, checked every
`reload_s`: a Kubernetes ConfigMap's symlink swap counts), without a restart; a file that
does not parse or validate is refused with an error in the log and the previous
configuration stays; so is a file that lists no key (an empty one, say, written by a tool
that truncates before it writes), which would otherwise serve anyone. Lookups compare SHA-256
digests of the presented key, so the time a lookup takes says nothing about the keys.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

__all__ = ["ANONYMOUS", "DEFAULT_TENANT", "Identity", "TenantBook", "TenantsConfig", "load_tenants"]

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"


class TenantConfig(BaseModel):
    """One tenant: its share against its priority's other tenants and its default priority."""

    model_config = ConfigDict(extra="forbid")
    weight: float = Field(1.0, gt=0, le=1e6)
    priority: int = Field(0, ge=-(2**31), lt=2**31)


class KeyConfig(BaseModel):
    """One API key: the tenant it speaks for and its limits (None = unlimited)."""

    model_config = ConfigDict(extra="forbid")
    key: str = Field(min_length=1, max_length=4096)
    tenant: str = Field(min_length=1, max_length=128)
    requests_per_s: float | None = Field(None, gt=0)
    tokens_per_min: float | None = Field(None, gt=0)
    trusted_proxy: bool = False

    @field_validator("key")
    @classmethod
    def _printable(cls, value: str) -> str:
        if not value.isprintable() or value != value.strip():
            raise ValueError("a key is printable text without surrounding spaces")
        return value


class TenantsConfig(BaseModel):
    """The whole `--tenants` file."""

    model_config = ConfigDict(extra="forbid")
    tenant_header: str = Field("x-pdplane-tenant", min_length=1, max_length=128)
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    keys: list[KeyConfig] = Field(default_factory=list)

    @field_validator("keys")
    @classmethod
    def _unique(cls, keys: list[KeyConfig]) -> list[KeyConfig]:
        seen: set[str] = set()
        for k in keys:
            if k.key in seen:
                raise ValueError(f"key of tenant {k.tenant!r} listed twice")
            seen.add(k.key)
        return keys

    @model_validator(mode="after")
    def _some_key(self) -> TenantsConfig:
        # A gateway given a tenants file requires one of its keys; one listing none would
        # serve anyone: an empty file (a config tool's non-atomic write, caught by the reload
        # poll) must not open the gateway.
        if not self.keys:
            raise ValueError(
                "lists no key: a gateway with a tenants file serves only its keys, and one "
                "listing none would serve anyone (run without --tenants for an open gateway)"
            )
        return self


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a request speaks for.

    Attributes:
        tenant: the tenant's name ("default" without a tenants file or for `--api-key` keys).
        priority: the tenant's default priority (vLLM's meaning: lower first).
        weight: the tenant's fair share within its priority.
        bucket: the rate limits' key: the API key's digest (plus the tenant a trusted proxy
            named); "" = no limits.
        requests_per_s, tokens_per_min: the key's limits (None = unlimited).
        capped: `priority` is the earliest a request may ask for (a key of the tenants file:
            its `priority` field may only make it later, else any key jumps its tenant's
            queue); False without a tenants file, where the field is vLLM's as sent.
    """

    tenant: str = DEFAULT_TENANT
    priority: int = 0
    weight: float = 1.0
    bucket: str = ""
    requests_per_s: float | None = None
    tokens_per_min: float | None = None
    capped: bool = False

    def priority_of(self, asked: int | None) -> int:
        """The flow-control priority of a request that asked for `asked` (its `priority`
        field; None = absent): the tenant's when absent, never earlier than it when capped."""
        if asked is None:
            return self.priority
        return max(asked, self.priority) if self.capped else asked


ANONYMOUS = Identity()
_PLAIN = TenantConfig.model_validate({})


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader refusing a mapping key given twice (PyYAML keeps the last one
    silently: a tenant or `keys:` listed twice would drop the first without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _unique_json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a name given twice (json keeps the last one silently)."""
    out: dict[str, Any] = {}
    for name, value in pairs:
        if name in out:
            raise ValueError(f"{name!r} given twice")
        out[name] = value
    return out


def load_tenants(path: str | os.PathLike[str]) -> TenantsConfig:
    """Parses and validates a tenants file (by its suffix: YAML, TOML or JSON); a name given
    twice in one mapping is refused in each format.

    Raises ValueError naming the file and the problem (unreadable, not parseable, invalid).
    """
    p = Path(path)
    try:
        text = p.read_bytes()
        suffix = p.suffix.lower()
        data: Any
        if suffix in (".yaml", ".yml"):
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no objects built
        elif suffix == ".toml":
            data = tomllib.loads(text.decode())
        elif suffix == ".json":
            data = json.loads(text, object_pairs_hook=_unique_json_object)
        else:
            raise ValueError("unknown format: name it .yaml, .yml, .toml or .json")
        return TenantsConfig.model_validate(data if data is not None else {})
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError, ValidationError) as exc:
        raise ValueError(f"tenants file {p}: {exc}") from None


def _digest(authorization: bytes) -> bytes:
    return hashlib.sha256(authorization).digest()


class TenantBook:
    """The current tenants and keys; identifies requests by their `Authorization` header.

    Args:
        path: the tenants file, or None (no tenants: keys of `flag_keys` only).
        flag_keys: the keys of `--api-key` (tenant "default", no limits).
        on_reload: called with "ok" or "error" after each attempt to read a changed file.
    """

    def __init__(
        self,
        path: str | None,
        flag_keys: tuple[str, ...] = (),
        on_reload: Callable[[str], None] | None = None,
    ) -> None:
        self.path = path
        self._flag = {_digest(f"Bearer {k}".encode()) for k in flag_keys}
        self._flag_count = len(flag_keys)
        self._on_reload = on_reload
        self._stamp: tuple[int, int, int] | None = None
        self.config = TenantsConfig.model_construct()  # no file: no key required, no tenants
        self._keys: dict[bytes, KeyConfig] = {}
        if path is not None:
            self._stamp = self._stat()
            self._apply(load_tenants(path))  # a bad file at startup is an error

    @property
    def required(self) -> bool:
        """Whether requests must present a key."""
        return bool(self._flag or self._keys)

    @property
    def header(self) -> bytes:
        """The lower-case tenant header a trusted proxy names tenants in."""
        return self.config.tenant_header.lower().encode("latin-1")

    def identify(self, authorization: bytes | None, named: str = "") -> Identity | None:
        """The identity of a request with this raw `Authorization` value (None = absent) and
        the tenant header's value `named` ("" = absent); None when the key is refused (401).
        """
        if not self.required:
            return ANONYMOUS
        if authorization is None:
            return None
        digest = _digest(authorization)
        key = self._keys.get(digest)
        if key is None:
            return ANONYMOUS if digest in self._flag else None
        tenant = named if (key.trusted_proxy and named) else key.tenant
        spec = self.config.tenants.get(tenant) or _PLAIN
        limited = key.requests_per_s is not None or key.tokens_per_min is not None
        return Identity(
            tenant=tenant,
            priority=spec.priority,
            weight=spec.weight,
            bucket=f"{digest[:12].hex()}/{tenant}" if limited else "",
            requests_per_s=key.requests_per_s,
            tokens_per_min=key.tokens_per_min,
            capped=True,
        )

    def _apply(self, config: TenantsConfig) -> None:
        # One assignment each: a request reading them mid-reload sees the old or the new map.
        self._keys = {_digest(f"Bearer {k.key}".encode()): k for k in config.keys}
        self.config = config

    def _stat(self) -> tuple[int, int, int]:
        assert self.path is not None
        st = os.stat(self.path)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def reload_if_changed(self) -> bool:
        """Reads the file again when it changed; True when a new configuration took effect.
        A file that is missing, unparseable or invalid is logged and the old one stays."""
        if self.path is None:
            return False
        try:
            stamp = self._stat()
        except OSError as exc:
            if self._stamp is not None:
                log.error("tenants file %s: %s; keeping the previous configuration", self.path, exc)
                self._stamp = None
                self._reloaded("error")
            return False
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            config = load_tenants(self.path)
        except ValueError as exc:
            log.error("%s; keeping the previous configuration", exc)
            self._reloaded("error")
            return False
        self._apply(config)
        log.info("%s reloaded", self.summary())
        self._reloaded("ok")
        return True

    def summary(self) -> str:
        """What is in force, for the log: the file, its tenants (listed or named by a key)
        and keys, and the `--api-key` keys beside them."""
        config = self.config
        tenants = set(config.tenants) | {k.tenant for k in config.keys}
        return (
            f"tenants file {self.path}: {len(tenants)} tenants, {len(config.keys)} keys "
            f"(and {self._flag_count} --api-key keys)"
        )

    def _reloaded(self, result: str) -> None:
        if self._on_reload is not None:
            self._on_reload(result)

    async def watch(self, every_s: float) -> None:
        """Logs what is in force, then checks the file every `every_s` s until cancelled (the
        app's lifespan runs it)."""
        if self.path is None:
            return
        log.info("%s; reread when it changes, checked every %g s", self.summary(), every_s)
        while True:
            await asyncio.sleep(every_s)
            self.reload_if_changed()
