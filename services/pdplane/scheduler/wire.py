"""The one place where the port's types meet protobuf (`pdplane.v1.scheduler_pb2`).

Used by both ends of the gRPC seam: the remote client (`pdplane.scheduler.remote`) and the
servicer (`pdplane.scheduler.servicer`). A new request feature is one line in each of
`features_to_pb` and `features_from_pb` (and its field in `RequestFeatures` and the proto).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np

from pdplane.core.prefix_hash import HASH_VERSION
from pdplane.scheduler.errors import InvalidRequest
from pdplane.scheduler.port import Decision, InstanceRef, Outcome, RequestFeatures, WarmHint
from pdplane.v1 import scheduler_pb2

if TYPE_CHECKING:
    from pdplane.scheduler.kv_index import KvInstanceStatus

__all__ = [
    "decision_from_pb",
    "decision_to_pb",
    "features_from_pb",
    "features_to_pb",
    "kv_states_to_pb",
    "outcome_from_pb",
    "outcome_to_pb",
    "releases_from_pb",
]

# Keyed by str: an Outcome is one, so a caller's plain "success" finds its entry as well.
_OUTCOME_TO_PB: dict[str, scheduler_pb2.Outcome.ValueType] = {
    Outcome.SUCCESS: scheduler_pb2.OUTCOME_SUCCESS,
    Outcome.FAILED: scheduler_pb2.OUTCOME_FAILED,
    Outcome.CANCELLED: scheduler_pb2.OUTCOME_CANCELLED,
    Outcome.UNSPECIFIED: scheduler_pb2.OUTCOME_UNSPECIFIED,
}
_OUTCOME_FROM_PB: dict[int, Outcome] = {n: Outcome(o) for o, n in _OUTCOME_TO_PB.items()}


def features_to_pb(features: RequestFeatures) -> scheduler_pb2.ScheduleRequest:
    """The `ScheduleRequest` carrying `features` (no piggybacked releases)."""
    return scheduler_pb2.ScheduleRequest(
        request_id=features.request_id,
        model=features.model,
        prompt_tokens=features.prompt_tokens,
        max_tokens=features.max_tokens,
        routing_key=features.routing_key,
        prefix_block_hashes=features.prefix_block_hashes,
        exclude_instance_ids=features.exclude_instance_ids,
        prefill_policy=features.prefill_policy,
        decode_policy=features.decode_policy,
        prefix_hashes=_prefix_hashes_to_pb(features.prefix_hashes),
        first_token_from_prefill=features.first_token_from_prefill,
    )


def _prefix_hashes_to_pb(
    prefix_hashes: Mapping[int, Sequence[int]],
) -> list[scheduler_pb2.PrefixHashes]:
    return [
        scheduler_pb2.PrefixHashes(
            block_size=block_size, block_hashes=hashes, hash_version=HASH_VERSION
        )
        for block_size, hashes in prefix_hashes.items()
    ]


def _prefix_hashes_from_pb(
    entries: Iterable[scheduler_pb2.PrefixHashes],
) -> dict[int, Sequence[int]]:
    out: dict[int, Sequence[int]] = {}
    for e in entries:
        if e.block_size in out:
            raise InvalidRequest(f"prefix_hashes: block_size {e.block_size} given twice")
        # Another version's hashes would never match this scheduler's index: as if unknown.
        if e.hash_version == HASH_VERSION:
            # A uint64 array straight from the message's buffer (2 us for an 8k-token prompt's
            # 512 hashes; a tuple of ints took 15 us), which the prefix index probes as is.
            out[e.block_size] = cast(Sequence[int], np.array(e.block_hashes, np.uint64))
    return out


def features_from_pb(request: scheduler_pb2.ScheduleRequest) -> RequestFeatures:
    """The features of a received `ScheduleRequest` (its `releases` are not features)."""
    return RequestFeatures(
        request_id=request.request_id,
        model=request.model,
        prompt_tokens=request.prompt_tokens,
        max_tokens=request.max_tokens,
        routing_key=request.routing_key,
        prefix_block_hashes=request.prefix_block_hashes,
        exclude_instance_ids=frozenset(request.exclude_instance_ids),
        prefill_policy=request.prefill_policy,
        decode_policy=request.decode_policy,
        prefix_hashes=_prefix_hashes_from_pb(request.prefix_hashes),
        first_token_from_prefill=request.first_token_from_prefill,
    )


def _ref_to_pb(ref: InstanceRef) -> scheduler_pb2.InstanceRef:
    return scheduler_pb2.InstanceRef(
        instance_id=ref.instance_id,
        url=ref.url,
        kv_endpoint=ref.kv_endpoint,
        transport=ref.transport,
    )


def decision_to_pb(decision: Decision) -> scheduler_pb2.ScheduleResponse:
    """The `ScheduleResponse` of a decision."""
    p = decision.prefill
    return scheduler_pb2.ScheduleResponse(
        prefill=_ref_to_pb(p) if p is not None else None,
        decode=_ref_to_pb(decision.decode),
        reason=decision.reason,
        prefill_cached_tokens=decision.prefill_cached_tokens,
        decode_cached_tokens=decision.decode_cached_tokens,
        warm=_warm_to_pb(decision.warm),
    )


def _warm_to_pb(warm: WarmHint | None) -> scheduler_pb2.WarmHint | None:
    if warm is None:
        return None
    return scheduler_pb2.WarmHint(
        instance=_ref_to_pb(warm.instance), prefix_tokens=warm.prefix_tokens
    )


def decision_from_pb(response: scheduler_pb2.ScheduleResponse) -> Decision:
    """The decision a `ScheduleResponse` carries; its sides are the response's `InstanceRef`
    messages themselves (no copy); an empty prefill ref is no prefill."""
    return Decision(
        response.prefill if response.prefill.instance_id else None,
        response.decode,
        response.reason,
        response.prefill_cached_tokens,
        response.decode_cached_tokens,
        WarmHint(response.warm.instance, response.warm.prefix_tokens)
        if response.HasField("warm") and response.warm.instance.instance_id
        else None,
    )


def outcome_to_pb(outcome: Outcome) -> scheduler_pb2.Outcome.ValueType:
    """The proto enum value of `outcome`; ValueError for anything but an `Outcome` (or its
    string value, e.g. "success")."""
    number = _OUTCOME_TO_PB.get(outcome)
    return _OUTCOME_TO_PB[Outcome.parse(outcome)] if number is None else number


def outcome_from_pb(number: int) -> Outcome:
    """The `Outcome` of a proto enum value; InvalidRequest for a value this side does not know."""
    outcome = _OUTCOME_FROM_PB.get(number)
    if outcome is None:
        raise InvalidRequest(f"outcome: unknown value {number}")
    return outcome


def releases_from_pb(
    releases: Iterable[scheduler_pb2.ReleaseRequest],
) -> list[tuple[str, Outcome]]:
    """(request id, outcome) per Release, all validated before any is applied; InvalidRequest
    on an empty id or an unknown outcome."""
    out = []
    for release in releases:
        outcome = outcome_from_pb(release.outcome)
        if not release.request_id:
            raise InvalidRequest("request_id: must not be empty")
        out.append((release.request_id, outcome))
    return out


def kv_states_to_pb(states: Iterable[KvInstanceStatus]) -> scheduler_pb2.ListKvStatesResponse:
    """The prefix index's instance states as a `ListKvStates` answer (ages in whole ms)."""
    return scheduler_pb2.ListKvStatesResponse(
        instances=[
            scheduler_pb2.KvIndexState(
                instance_id=s.instance_id,
                state=s.state.value,
                reason=s.reason,
                blocks=s.blocks,
                lag_events=max(s.lag_events, 0),
                last_message_age_ms=min(int(s.last_message_age_s * 1000), 2**32 - 1),
                snapshots=s.snapshots,
            )
            for s in states
        ]
    )
