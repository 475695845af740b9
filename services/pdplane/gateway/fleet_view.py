"""What the gateway knows about the fleet: models served, usable pairs, for /v1/models and /health.

Built from the registry watcher's view once per change (on the watcher's thread) and swapped in
atomically, so the request path only reads a ready-made `FleetView`. Which instances make a
usable pair is the scheduler's rule, read from `pdplane.core.instance.pairing` like the scheduler
does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdplane.core.instance.pairing import can_decode, can_prefill, pair_key
from pdplane.v1 import instance_pb2

__all__ = ["FleetTracker", "FleetView", "ModelState", "Publication", "build_view"]


@dataclass(frozen=True, slots=True)
class Publication:
    """The SERVING instances of a model that publish one tokenizer (`content_hash`; "" = the
    instances that publish none), in instance id order, with where to fetch it from."""

    content_hash: str
    instances: tuple[str, ...]
    kv_endpoints: tuple[str, ...]
    urls: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ModelState:
    """One served model across the fleet.

    Attributes:
        prefill: SERVING instances able to prefill (role PREFILL or BOTH).
        decode: SERVING instances able to decode (role DECODE or BOTH).
        paired: whether some prefill and some decode share KV layout, transport and max length.
        max_model_len: the largest max model length of its instances (tokens).
        created: earliest registration time of its instances (Unix seconds).
        urls: OpenAI base URLs of its SERVING instances (any role), for the read-only routes.
        block_sizes: the KV cache block sizes (tokens) of its SERVING instances, ascending:
            the sizes its prompts' prefix block hashes are computed at.
        tokenizers: the tokenizers its SERVING instances publish, by content hash ascending
            ("" first: those that publish none).
        decode_kv_tokens: the KV cache of its SERVING decode instances, in tokens (their
            load reports' total blocks x block size; 0 = not reported yet).
        prefill_ids, decode_ids: the ids of the instances counted in `prefill` / `decode`.
        registered_ns: their registration times (Unix ns), by id: an id registered again
            (a restarted instance) is a new process.
        changed_at: when this gateway saw `registered_ns` change last (time.monotonic(), s;
            0.0 = as in the first snapshot): an instance came, left or registered again.
    """

    prefill: int
    decode: int
    paired: bool
    max_model_len: int
    created: int
    urls: tuple[str, ...] = ()
    block_sizes: tuple[int, ...] = ()
    tokenizers: tuple[Publication, ...] = ()
    decode_kv_tokens: int = 0
    prefill_ids: frozenset[str] = frozenset()
    decode_ids: frozenset[str] = frozenset()
    registered_ns: Mapping[str, int] = field(default_factory=dict)
    changed_at: float = 0.0

    def problem(self) -> str:
        """Why no request of this model can be served now; "" when a usable pair exists."""
        if self.paired:
            return ""
        if self.prefill == 0 and self.decode == 0:
            return "no instance is serving (all draining)"
        if self.prefill == 0:
            return "no prefill instance"
        if self.decode == 0:
            return "no decode instance"
        return "no prefill and decode instance with equal KV layout, transport and max length"


@dataclass(frozen=True, slots=True)
class FleetView:
    """An immutable picture of the fleet: model name -> ModelState.

    `ready` is False until the registry watcher delivered its first snapshot.
    """

    models: dict[str, ModelState] = field(default_factory=dict)
    ready: bool = False

    def longest_model_len(self) -> int:
        """The largest `max_model_len` of the served models (tokens); 0 when none is known."""
        return max((m.max_model_len for m in self.models.values()), default=0)

    def models_list(self) -> dict[str, Any]:
        """The OpenAI `GET /v1/models` body: `{"object": "list", "data": [model, ...]}`."""
        data = [
            {
                "id": name,
                "object": "model",
                "created": state.created,
                "owned_by": "pdplane",
                "root": name,
                "parent": None,
                "max_model_len": state.max_model_len,
            }
            for name, state in sorted(self.models.items())
        ]
        return {"object": "list", "data": data}

    def health(self, model: str | None = None) -> tuple[bool, dict[str, Any]]:
        """(ready, body) for `GET /health` (`model` None) and `GET /health?model=NAME`.

        The gateway is ready when at least one model has a usable pair: a model that lost its
        pair must not make a readiness probe or a load balancer stop the traffic of the models
        that serve. `status` is "ok" when every model has a pair, "degraded" (still ready) when
        some lack one, "unavailable" when none has. With `model`, the answer is that model's
        alone: ready when it has a usable pair (an unknown model has none). The body lists per
        model its prefill/decode counts (only `model`'s when given); `reason` names every
        model that cannot be served and why.
        """
        models = {
            name: {"prefill": s.prefill, "decode": s.decode, "paired": s.paired}
            for name, s in sorted(self.models.items())
        }
        states = self.models if model is None else {model: self.models.get(model)}
        if model is not None:
            models = {name: entry for name, entry in models.items() if name == model}
        problems = {
            name: "no instance registered" if s is None else s.problem()
            for name, s in states.items()
        }
        if not self.ready:
            reason = "registry not reachable yet (no snapshot of the instances)"
        elif not states:
            reason = "no instances registered"
        else:
            reason = "; ".join(f"model {n!r}: {why}" for n, why in problems.items() if why)
        ready = self.ready and not all(problems.values()) and bool(states)
        status = "unavailable" if not ready else "degraded" if reason else "ok"
        body: dict[str, Any] = {"status": status, "models": models}
        if model is not None:
            body = {"status": status, "model": model, "models": models}
        if reason:
            body["reason"] = reason
        return ready, body


def _model_state(
    instances: list[instance_pb2.Instance], created: int, before: ModelState | None, now: float
) -> ModelState:
    live = [i for i in instances if i.state == instance_pb2.INSTANCE_STATE_SERVING]
    serving = [i.spec for i in live]
    prefills = [spec for spec in serving if can_prefill(spec.role)]
    decodes = [spec for spec in serving if can_decode(spec.role)]
    registered = {i.spec.instance_id: i.registered_at.ToNanoseconds() for i in live}
    changed_at = now if before is None or before.registered_ns != registered else before.changed_at
    kv_tokens = sum(
        i.load.total_kv_blocks * i.spec.kv_layout.block_size
        for i in live
        if can_decode(i.spec.role)
    )
    return ModelState(
        prefill=len(prefills),
        decode=len(decodes),
        paired=bool({pair_key(p) for p in prefills} & {pair_key(d) for d in decodes}),
        max_model_len=max(i.spec.max_model_len for i in instances),
        created=created,
        urls=tuple(sorted({spec.url for spec in serving})),
        block_sizes=tuple(sorted({s.kv_layout.block_size for s in serving} - {0})),
        tokenizers=_publications(serving),
        decode_kv_tokens=kv_tokens,
        prefill_ids=frozenset(spec.instance_id for spec in prefills),
        decode_ids=frozenset(spec.instance_id for spec in decodes),
        registered_ns=registered,
        changed_at=changed_at,
    )


def _publications(serving: list[instance_pb2.InstanceSpec]) -> tuple[Publication, ...]:
    by_hash: dict[str, list[instance_pb2.InstanceSpec]] = {}
    for spec in serving:
        by_hash.setdefault(spec.tokenizer_hash, []).append(spec)
    out = []
    for content_hash, specs in sorted(by_hash.items()):
        specs.sort(key=lambda spec: spec.instance_id)
        out.append(
            Publication(
                content_hash,
                tuple(spec.instance_id for spec in specs),
                tuple(spec.kv_endpoint for spec in specs),
                tuple(spec.url for spec in specs),
            )
        )
    return tuple(out)


def build_view(
    instances: Iterable[instance_pb2.Instance], before: FleetView | None = None
) -> FleetView:
    """A ready FleetView of the registry's `instances` (any state; DRAINING ones are listed but
    never count towards a usable pair). `before`: the view it follows, whose models' SERVING
    instances are compared to date each model's `changed_at` (None or not ready: 0.0)."""
    by_model: dict[str, list[instance_pb2.Instance]] = {}
    created: dict[str, int] = {}
    for inst in instances:
        model = inst.spec.model
        by_model.setdefault(model, []).append(inst)
        seconds = inst.registered_at.seconds
        created[model] = min(created.get(model, seconds), seconds)
    now = time.monotonic()
    if before is None or not before.ready:
        old: dict[str, ModelState] = {}
        now = 0.0
    else:
        old = before.models
    models = {m: _model_state(insts, created[m], old.get(m), now) for m, insts in by_model.items()}
    return FleetView(models=models, ready=True)


class FleetTracker:
    """Keeps `view` current from the registry (`pdplane.registry.client.InstanceWatcher`).

    It is also the `pdplane.scheduler.InstanceSource` of a local scheduler: `snapshot()` is the
    instances of the latest change and `revision` counts the changes seen, so it moves on every
    change, even when a restarted registry reuses its revision numbers.

    Args:
        registry: registry gRPC address host:port.
        token: bearer token for the registry.
        tls_ca: PEM CA file when the registry serves TLS.
    """

    def __init__(self, registry: str, *, token: str | None = None, tls_ca: str | None = None):
        from pdplane.registry.client import InstanceWatcher

        self.view = FleetView()
        self._listeners: list[Callable[[], None]] = []
        self._instances: Mapping[str, instance_pb2.Instance] = {}
        self._changes = 0
        self._watcher = InstanceWatcher(
            registry, token=token, tls_ca=tls_ca, on_change=self._on_change
        )

    @property
    def revision(self) -> int:
        """How many changes of the registry's instances this tracker has seen."""
        return self._changes

    def snapshot(self) -> Mapping[str, instance_pb2.Instance]:
        """The instances by id, as of the latest change (never mutated afterwards)."""
        return self._instances

    def _on_change(self, instances: dict[str, instance_pb2.Instance]) -> None:
        # The instances first, then the count: a reader that sees the new count sees them.
        self._instances = instances
        self._changes += 1
        self.view = build_view(instances.values(), self.view)
        for listener in self._listeners:
            listener()

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Calls `listener()` after each change of `view` (on the watcher's thread: it must
        return at once, e.g. `loop.call_soon_threadsafe(event.set)`). Add before `start`."""
        self._listeners.append(listener)

    def start(self, wait_s: float) -> bool:
        """Starts watching; blocks up to `wait_s` s for the first snapshot (True once it came)."""
        self._watcher.start()
        return self._watcher.wait_ready(wait_s)

    def stop(self) -> None:
        """Stops watching (bounded, ~2 s at most)."""
        self._watcher.stop()
