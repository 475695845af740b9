"""Each served model's tokenizer, taken from the fleet, and whether its routing is precise.

KV-aware routing needs the prompt's exact token ids, hence the model's tokenizer and the chat
template the instances render with. Every instance publishes both (`pdplane.v1.TokenizerFiles`
on its KV endpoint, the content hash in its registry spec), so the gateway needs no flag per
model: for each model it follows which tokenizer its SERVING instances publish and

- when they agree on one, fetches it once (bounded chunks, every byte checked against the
  hash, `pdplane.core.tokenizer.fetch`), loads it (no code from the network: data files and a
  sandboxed Jinja template), and checks it against an instance: the instance's own `/tokenize`
  of a fixed text and a fixed chat must equal the gateway's ids, which catches a chat template
  the instance takes from elsewhere (a processor's, vLLM's fallback for the model type);
- when they disagree, or none publishes one, or the fetch or the check failed, routes that
  model by load (prefix hashes only for prompts given as token ids) and says why.

The state of every model is one `RoutingState`: in `/health`, in the gauge
`pdplane_gateway_routing_precise{model}` and in one log line each time it changes.
`--tokenizer` (a `TokenizerSet`) overrides the fleet for the models it names.
A failed fetch or check is retried with backoff (1 s doubling to 60 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdplane.core.grpc.util import aio_channel, token_metadata
from pdplane.core.tokenizer.fetch import FetchError, fetch_tokenizer
from pdplane.gateway.fleet_view import FleetView, Publication
from pdplane.gateway.metrics import GatewayMetrics
from pdplane.gateway.prompt_ids import PromptTokenizer, TokenizerSet
from pdplane.gateway.upstream import UpstreamClient, UpstreamTimeout, UpstreamUnreachable
from pdplane.v1 import tokenizer_pb2

__all__ = ["FleetTokenizers", "RoutingState"]

log = logging.getLogger(__name__)

#: Instances a fetch is tried from before it counts as failed.
_FETCH_TRIES = 3
_RETRY_FIRST_S = 1.0
_RETRY_MAX_S = 60.0
#: Instance ids named in a reason at most, per tokenizer.
_NAMED = 3
_PROBE_TEXT = "Prefill, decode: KV cache blocks.\n  Ünïcödé 漢字 🙂 1234 <tags> \t end"
_PROBE_CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Hello! 漢字?"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Count: 1 2 3"},
]


@dataclass(frozen=True, slots=True)
class RoutingState:
    """How one model's requests are routed.

    Attributes:
        precise: True when the gateway has the model's tokenizer: prompts get exact token ids
            and prefix block hashes (KV-aware routing); False = by load only.
        reason: one line: where the tokenizer came from, or why there is none.
        tokenizer: the content hash in use, "--tokenizer DIR", or "" (none).
    """

    precise: bool
    reason: str
    tokenizer: str = ""

    def as_json(self) -> dict[str, Any]:
        """The model's routing fields of the /health body."""
        return {
            "routing": "precise" if self.precise else "load",
            "routing_reason": self.reason,
            "tokenizer": self.tokenizer,
        }


def _short(content_hash: str) -> str:
    return content_hash[: len("sha256:") + 12]


_RETRY_NOTE = " (retrying in "


def _settled_reason(reason: str) -> str:
    """`reason` without its retry countdown (which changes on every retry)."""
    return reason.split(_RETRY_NOTE, 1)[0]


def _named(instances: tuple[str, ...]) -> str:
    more = len(instances) - _NAMED
    return ", ".join(instances[:_NAMED]) + (f" and {more} more" if more > 0 else "")


@dataclass
class _Failure:
    reason: str
    retry_at: float  # time.monotonic()
    backoff_s: float


class FleetTokenizers:
    """The served models' tokenizers from the fleet (see the module docstring).

    Args:
        override: tokenizers from `--tokenizer` (they win for the models they cover).
        cache_dir: where fetched tokenizers are kept, one directory per content hash.
        upstream: the gateway's HTTP client (the `/tokenize` check).
        metrics: the gateway's metrics (`routing_precise`).
        token: bearer token of the instances' KV gRPC servers.
        tls_ca: PEM CA when those serve TLS.
        upstream_api_key: bearer token of the instances' HTTP API (vLLM `--api-key`).
        fetch_timeout_s: bound on one fetch (s).
    """

    def __init__(
        self,
        override: TokenizerSet,
        *,
        cache_dir: Path,
        upstream: UpstreamClient,
        metrics: GatewayMetrics,
        token: str | None = None,
        tls_ca: str | None = None,
        upstream_api_key: str | None = None,
        fetch_timeout_s: float = 60.0,
    ) -> None:
        self._override = override
        self._cache = cache_dir
        self._upstream = upstream
        self._metrics = metrics
        self._metadata = token_metadata(token)
        self._tls_ca = tls_ca
        self._http_headers = {"content-type": "application/json"}
        if upstream_api_key:
            self._http_headers["authorization"] = f"Bearer {upstream_api_key}"
        self._fetch_timeout_s = fetch_timeout_s
        self._view: FleetView | None = None
        self._published: dict[str, tuple[Publication, ...]] = {}
        self._states: dict[str, RoutingState] = {}
        self._said: dict[str, tuple[bool, str]] = {}  # what the log said last, per model
        self._by_model: dict[str, PromptTokenizer] = {}
        self._loaded: dict[str, PromptTokenizer] = {}  # content hash -> tokenizer
        self._failures: dict[str, _Failure] = {}  # content hash -> last failure
        self._tasks: dict[str, asyncio.Task[None]] = {}  # content hash -> its fetch
        self._retry: asyncio.TimerHandle | None = None

    # -- the request path ----------------------------------------------------------------------

    def get(self, model: str) -> PromptTokenizer | None:
        """The tokenizer for `model`'s prompts: `--tokenizer`'s, else the fleet's once
        fetched and checked; None = route by load."""
        tokenizer = self._override.get(model)
        return tokenizer if tokenizer is not None else self._by_model.get(model)

    def observe(self, view: FleetView) -> None:
        """Takes the fleet's current view (cheap when it is the one seen last); starts the
        fetches it calls for. Call it from the event loop."""
        if view is self._view:
            return
        self._view = view
        for model, state in view.models.items():
            if self._published.get(model) != state.tokenizers or model not in self._states:
                self._published[model] = state.tokenizers
                self._decide(model)
        for model in [m for m in self._states if m not in view.models]:
            del self._states[model]
            self._said.pop(model, None)
            self._published.pop(model, None)
            self._by_model.pop(model, None)
            self._metrics.routing_precise.remove(model)

    def states(self) -> Mapping[str, RoutingState]:
        """Every served model's routing state, by model name."""
        return dict(self._states)

    # -- deciding ------------------------------------------------------------------------------

    def _decide(self, model: str) -> None:
        override = self._override.get(model)
        if override is not None:
            source = f"--tokenizer {override.path}"
            self._set(model, RoutingState(True, "tokenizer from --tokenizer", source))
            return
        publications = self._published.get(model, ())
        published = [p for p in publications if p.content_hash]
        silent = [p for p in publications if not p.content_hash]
        if not published:
            self._set(
                model,
                RoutingState(
                    False,
                    "no instance publishes its tokenizer (a connector or simulator without "
                    "one: see its log); prompts given as token ids are still routed by their "
                    "prefix, or give the gateway --tokenizer",
                ),
            )
            return
        if len(published) > 1:
            listed = "; ".join(
                f"{_short(p.content_hash)} by {_named(p.instances)}" for p in published
            )
            self._set(
                model, RoutingState(False, f"its instances publish different tokenizers: {listed}")
            )
            return
        pub = published[0]
        silent_note = f" ({_named(silent[0].instances)} publish none)" if silent else ""
        tokenizer = self._loaded.get(pub.content_hash)
        if tokenizer is not None:
            self._set(
                model,
                RoutingState(
                    True,
                    f"tokenizer published by {_named(pub.instances)}{silent_note}",
                    pub.content_hash,
                ),
                tokenizer,
            )
            return
        failure = self._failures.get(pub.content_hash)
        if failure is not None and time.monotonic() < failure.retry_at:
            self._set(model, RoutingState(False, failure.reason, pub.content_hash))
            self._retry_later(failure.retry_at)
            return
        if pub.content_hash not in self._tasks:
            self._tasks[pub.content_hash] = asyncio.get_running_loop().create_task(
                self._fetch(model, pub), name=f"pdplane-tokenizer-fetch-{model}"
            )
        self._set(
            model,
            RoutingState(
                False,
                f"fetching tokenizer {_short(pub.content_hash)} from {pub.instances[0]}",
                pub.content_hash,
            ),
        )

    def _set(
        self, model: str, state: RoutingState, tokenizer: PromptTokenizer | None = None
    ) -> None:
        if tokenizer is None:
            self._by_model.pop(model, None)
        else:
            self._by_model[model] = tokenizer
        self._states[model] = state
        self._metrics.routing_precise.labels(model).set(1 if state.precise else 0)
        said = (state.precise, _settled_reason(state.reason))
        if state.reason.startswith("fetching") or self._said.get(model) == said:
            return  # one line per change: not per fetch, nor per retry of the same failure
        self._said[model] = said
        if state.precise:
            log.info("model %s: routing is precise (KV-aware): %s", model, state.reason)
        else:
            log.warning("model %s: routing by load only: %s", model, state.reason)

    def _redecide(self, content_hash: str | None = None) -> None:
        for model, publications in self._published.items():
            if content_hash is None or any(p.content_hash == content_hash for p in publications):
                self._decide(model)

    def _retry_later(self, at: float) -> None:
        if self._retry is not None and self._retry.when() <= at:
            return
        if self._retry is not None:
            self._retry.cancel()
        loop = asyncio.get_running_loop()
        delay = max(0.0, at - time.monotonic())
        self._retry = loop.call_later(delay, self._retry_now)

    def _retry_now(self) -> None:
        self._retry = None
        self._redecide()

    # -- fetching ------------------------------------------------------------------------------

    async def _fetch(self, model: str, pub: Publication) -> None:
        content_hash = pub.content_hash
        try:
            tokenizer = await self._fetch_and_check(model, pub)
        except Exception as exc:  # any failure routes by load, with the reason, and retries
            previous = self._failures.get(content_hash)
            backoff = (
                _RETRY_FIRST_S if previous is None else min(previous.backoff_s * 2, _RETRY_MAX_S)
            )
            self._failures[content_hash] = _Failure(
                f"tokenizer {_short(content_hash)}: {exc}{_RETRY_NOTE}{backoff:g} s)",
                time.monotonic() + backoff,
                backoff,
            )
        else:
            self._loaded[content_hash] = tokenizer
            self._failures.pop(content_hash, None)
        finally:
            self._tasks.pop(content_hash, None)
        self._redecide(content_hash)

    async def _fetch_and_check(self, model: str, pub: Publication) -> PromptTokenizer:
        errors: list[str] = []
        for instance, endpoint, url in list(
            zip(pub.instances, pub.kv_endpoints, pub.urls, strict=True)
        )[:_FETCH_TRIES]:
            channel = aio_channel(endpoint, self._tls_ca)
            try:
                directory, manifest = await fetch_tokenizer(
                    channel,
                    pub.content_hash,
                    self._cache,
                    metadata=self._metadata,
                    timeout_s=self._fetch_timeout_s,
                )
            except FetchError as exc:
                errors.append(f"{instance}: {exc}")
                continue
            finally:
                await channel.close()
            tokenizer = await asyncio.to_thread(_load, directory, manifest)
            mismatch = await self._check(tokenizer, model, url)
            if mismatch:
                raise ValueError(f"{instance}'s /tokenize disagrees with it: {mismatch}")
            return tokenizer
        raise FetchError("; ".join(errors) or "no instance to fetch from")

    async def _check(self, tokenizer: PromptTokenizer, model: str, url: str) -> str:
        """What differs between the instance's `/tokenize` and `tokenizer`; "" = nothing."""
        ours_text = tokenizer.completion_ids({"prompt": _PROBE_TEXT}, 0)
        theirs_text = await self._tokenize(url, {"model": model, "prompt": _PROBE_TEXT})
        if theirs_text is not None and theirs_text != ours_text:
            return "the ids of a text prompt"
        ours_chat = tokenizer.chat_ids({"messages": _PROBE_CHAT}, 0)
        theirs_chat = await self._tokenize(
            url, {"model": model, "messages": _PROBE_CHAT, "add_generation_prompt": True}
        )
        if theirs_chat != ours_chat and not (theirs_chat is None and ours_chat is None):
            if ours_chat is None:
                return "the instance renders chats with a template the tokenizer lacks"
            return "the ids of a chat (another chat template)"
        return ""

    async def _tokenize(self, url: str, body: dict[str, Any]) -> list[int] | None:
        """The instance's `/tokenize` ids for `body`; None when it answers without ids (a 400:
        e.g. no chat template). Raises ValueError when it cannot be asked."""
        try:
            resp = await self._upstream.open(
                f"{url}/tokenize",
                json.dumps(body).encode(),
                self._http_headers,
                read_timeout_s=10.0,
                total_timeout_s=10.0,
            )
            data = await self._upstream.read(resp)
        except (UpstreamUnreachable, UpstreamTimeout) as exc:
            raise ValueError(f"cannot check it against {url}/tokenize: {exc}") from None
        if resp.status != 200:
            return None
        tokens = json.loads(data).get("tokens")
        return tokens if isinstance(tokens, list) else None

    # -- lifecycle -----------------------------------------------------------------------------

    async def follow(self, fleet: Callable[[], FleetView], changed: asyncio.Event) -> None:
        """Observes `fleet()` whenever `changed` is set (the registry watcher's signal), and
        at least every second; runs until cancelled."""
        while True:
            self.observe(fleet())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), 1.0)
            changed.clear()

    async def close(self) -> None:
        """Cancels fetches in flight."""
        if self._retry is not None:
            self._retry.cancel()
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _load(directory: Path, manifest: tokenizer_pb2.TokenizerManifest) -> PromptTokenizer:
    kwargs = json.loads(manifest.default_chat_template_kwargs or "{}")
    return PromptTokenizer(
        directory,
        chat_template=manifest.chat_template or None,
        chat_template_kwargs=kwargs if isinstance(kwargs, dict) else None,
        use_fast=manifest.tokenizer_mode != "slow",
    )
