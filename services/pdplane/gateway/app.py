"""The gateway's FastAPI app factory: wires scheduler port, fleet view, relay and routes."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp

from pdplane.core import defaults
from pdplane.gateway.aftercare import KvAborter
from pdplane.gateway.auth import ApiKeys
from pdplane.gateway.config import RelayConfig
from pdplane.gateway.errors import error_body
from pdplane.gateway.fleet_tokenizers import FleetTokenizers
from pdplane.gateway.fleet_view import FleetTracker, FleetView
from pdplane.gateway.flow import FlowControl
from pdplane.gateway.metrics import GatewayMetrics
from pdplane.gateway.passthrough import Passthrough
from pdplane.gateway.prompt_ids import TokenizerSet, load_tokenizers
from pdplane.gateway.ratelimit import RateLimiter
from pdplane.gateway.relay import Relay
from pdplane.gateway.relay_endpoints import RelayEndpoints
from pdplane.gateway.routes import build_router
from pdplane.gateway.settings import GatewaySettings
from pdplane.gateway.tenants import TenantBook
from pdplane.gateway.upstream import UpstreamClient
from pdplane.scheduler import SchedulerPort, open_scheduler

__all__ = ["create_app"]

log = logging.getLogger(__name__)


class _GatewayApi(FastAPI):
    """FastAPI with the relay endpoints in front of its whole middleware stack.

    They are the hot path and answer every error themselves (see pdplane.gateway.relay_endpoints);
    behind Starlette's error middleware, its wrapper around every `send` (one per relayed SSE
    chunk) measured ~5% of the gateway's CPU per request.
    """

    def __init__(self, relay_endpoints: Callable[[ASGIApp], ASGIApp], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._relay_endpoints = relay_endpoints

    def build_middleware_stack(self) -> ASGIApp:
        return self._relay_endpoints(super().build_middleware_stack())


def create_app(
    settings: GatewaySettings,
    *,
    scheduler: SchedulerPort | None = None,
    fleet: Callable[[], FleetView] | None = None,
    tokenizers: TokenizerSet | None = None,
) -> FastAPI:
    """The gateway app for `settings`.

    `scheduler` and `fleet` replace the real scheduler port and registry view (tests; the app
    then does not close that port); otherwise the app opens `settings.scheduler` with
    `pdplane.scheduler.open_scheduler` (with `--scheduler embedded`, a local scheduler deciding
    over the registry view, its metrics on the gateway's /metrics) and watches
    `settings.registry` from its lifespan's startup (waiting up to `registry_wait_s` for the
    first snapshot) and closes everything at shutdown. Each model's tokenizer comes from its
    instances (`pdplane.gateway.fleet_tokenizers`); `tokenizers` replaces the overrides loaded
    from `settings.tokenizer`. Raises ValueError for an embedded scheduler with a `fleet`
    override.
    """
    metrics = GatewayMetrics()
    if tokenizers is None:
        tokenizers = load_tokenizers(settings.tokenizer, settings.trust_remote_code)
    upstream = UpstreamClient(
        connect_timeout_s=settings.connect_timeout_s, max_connections=settings.max_connections
    )
    fleet_tokenizers = FleetTokenizers(
        tokenizers,
        cache_dir=tokenizer_cache(settings.tokenizer_cache_dir),
        upstream=upstream,
        metrics=metrics,
        token=settings.token,
        tls_ca=settings.tls_ca,
        upstream_api_key=settings.upstream_api_key,
    )
    aborter = KvAborter(
        token=settings.token, tls_ca=settings.tls_ca, timeout_s=settings.abort_timeout_s
    )
    tracker = None
    if fleet is None:
        tracker = FleetTracker(settings.registry, token=settings.token, tls_ca=settings.tls_ca)
        fleet = lambda: tracker.view  # noqa: E731
    owned_scheduler = None
    if scheduler is None:
        if settings.embedded_scheduler and tracker is None:
            raise ValueError("--scheduler embedded needs the registry view (no `fleet` override)")
        scheduler = owned_scheduler = open_scheduler(
            settings, source=tracker, metrics_registry=metrics.registry
        )
    config = RelayConfig(
        dispatch=settings.dispatch,
        upstream_timeout_s=settings.upstream_timeout_s,
        stream_idle_timeout_s=settings.stream_idle_timeout_s,
        max_retries=settings.max_retries,
        upstream_api_key=settings.upstream_api_key,
        queue_timeout_s=settings.queue_timeout_s,
        max_queued_requests=settings.max_queued_requests,
        first_token=settings.first_token,
        prompt_tokens_details=settings.enable_prompt_tokens_details,
        migration_limit=settings.migration_limit,
        migration_timeout_s=settings.migration_timeout_s,
        drain_grace_s=settings.drain_grace_s,
    )
    relay = Relay(scheduler, upstream, aborter, metrics, config, fleet_tokenizers, fleet)
    book = TenantBook(
        settings.tenants,
        settings.api_keys(),
        on_reload=lambda result: metrics.tenants_reloads.labels(result).inc(),
    )
    flow = FlowControl(
        partial(_budget, fleet, settings.inflight_budget),
        settings.queue_timeout_s if settings.inflight_budget > 0 else 0.0,
        settings.max_queued_requests,
        metrics,
        settings.flow_policy,
    )
    if flow.timeout_s > 0:
        metrics.flow_budget_tokens.source = partial(_budgets, fleet, settings.inflight_budget)
    limiter = RateLimiter(lambda tenant, kind: metrics.rate_limited.labels(tenant, kind).inc())

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        changed = asyncio.Event()
        departed = asyncio.Event()  # decodes that leave or drain: their streams move
        moving = None
        if tracker is not None:
            loop = asyncio.get_running_loop()

            def on_change() -> None:
                loop.call_soon_threadsafe(changed.set)
                loop.call_soon_threadsafe(departed.set)

            tracker.add_listener(on_change)
            moving = asyncio.create_task(
                relay.departures.follow(tracker.snapshot, departed), name="pdplane-departures"
            )
            ready = await asyncio.to_thread(tracker.start, settings.registry_wait_s)
            if not ready:
                log.warning("registry %s not reachable yet; /health answers 503", settings.registry)
        following = asyncio.create_task(
            fleet_tokenizers.follow(fleet, changed), name="pdplane-fleet-tokenizers"
        )
        watching = asyncio.create_task(
            book.watch(settings.tenants_reload_s), name="pdplane-tenants-file"
        )
        if owned_scheduler is not None:
            await owned_scheduler.start()  # embedded: the in-flight exchange with --peers
        try:
            yield
        finally:
            watching.cancel()
            following.cancel()
            if moving is not None:
                moving.cancel()
            relay.departures.close()
            await fleet_tokenizers.close()
            await relay.drain()
            await upstream.close()
            await aborter.close()
            if owned_scheduler is not None:
                await owned_scheduler.close()
            if tracker is not None:
                await asyncio.to_thread(tracker.stop)

    keys = ApiKeys(book)
    app = _GatewayApi(
        partial(
            RelayEndpoints,
            relay=relay,
            fleet=fleet,
            metrics=metrics,
            api_keys=keys,
            flow=flow,
            limiter=limiter,
            body_timeout_s=settings.body_timeout_s,
            tokenizers=fleet_tokenizers,
            access_log=settings.access_log,
        ),
        title="pdplane gateway",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    passthrough = Passthrough(fleet, upstream, settings.upstream_api_key)
    app.include_router(
        build_router(
            fleet,
            metrics,
            keys,
            passthrough,
            fleet_tokenizers.states,
            scheduler.problem,
            settings.body_timeout_s,
        )
    )
    app.add_exception_handler(HTTPException, _http_error)
    app.state.relay = relay
    app.state.flow = flow
    app.state.tenants = book
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.state.tokenizers = fleet_tokenizers
    return app


def _budget(fleet: Callable[[], FleetView], fraction: float, model: str) -> tuple[int, int] | None:
    """`model`'s in-flight budget and ceiling (tokens): `fraction` x its decode instances' KV
    cache, and that KV cache (the most tenants within their shares may reach); None
    (unlimited) while it is unknown or no decode serves it (requests then reach the scheduler,
    whose refusal makes them wait in the admission queue)."""
    state = fleet().models.get(model)
    if state is None or state.decode_kv_tokens <= 0:
        return None
    budget = max(1, int(state.decode_kv_tokens * fraction))
    return budget, max(budget, state.decode_kv_tokens)


def _budgets(fleet: Callable[[], FleetView], fraction: float) -> Iterator[tuple[str, float]]:
    """(model, its in-flight budget in tokens) of every model whose budget is known now."""
    for model in fleet().models:
        limits = _budget(fleet, fraction, model)
        if limits is not None:
            yield model, float(limits[0])


def tokenizer_cache(configured: str | None) -> Path:
    """Where fetched tokenizers are kept: `configured`, else $PDPLANE_CACHE_DIR/tokenizers or
    ~/.cache/pdplane/tokenizers; a fresh temporary folder when that cannot be written (a
    container with a read-only home)."""
    path = Path(configured) if configured else defaults.cache_root() / "tokenizers"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    fallback = Path(tempfile.mkdtemp(prefix="pdplane-tokenizers-"))
    log.info("tokenizer cache %s is not writable; using %s", path, fallback)
    return fallback


async def _http_error(_request: Request, exc: Exception) -> Response:
    # Unknown paths and wrong methods answer in the OpenAI error shape like everything else.
    assert isinstance(exc, HTTPException)
    return Response(
        error_body(exc.status_code, str(exc.detail)),
        exc.status_code,
        headers=exc.headers,
        media_type="application/json",
    )
