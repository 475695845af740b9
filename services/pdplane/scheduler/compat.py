"""Compatibility filter and decode guard: which instances may serve one request.

Per side (prefill: role PREFILL/BOTH; decode: role DECODE/BOTH) an instance qualifies when it
serves the model (the view is already grouped by model), is SERVING (not DRAINING), is not
excluded by the request, has `max_model_len >= prompt_tokens + max_tokens` and, for decode,
has KV room for the request when its load report says how much (`total_kv_blocks > 0`):
`(free_kv_blocks - blocks already assigned since that report) * block_size >= tokens`.
Pairing (equal layout fingerprint, transport and max model length) happens in `pair`.

Push mode: a decode that takes pushes (`recv_buffer_capacity_bytes > 0`) and whose receive
buffer cannot take the prompt's KV (`recv_buffer_headroom_bytes - blocks assigned since the
report * kv_block_bytes < blocks_for(prompt) * kv_block_bytes`) is picked only when no decode
with room is left: its prefill's push would be refused and decode would pull instead, which
works but loses what push buys.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from pdplane.core.echo import echo
from pdplane.scheduler.candidate import Candidate, PairKey
from pdplane.scheduler.errors import NoInstance, NoRoom
from pdplane.v1 import instance_pb2

__all__ = ["SideCandidates", "blocks_for", "describe_keys", "pair_keys_of", "split_sides"]


def blocks_for(tokens: int, block_size: int) -> int:
    """KV cache blocks holding `tokens` tokens (ceil); 0 when the block size is unknown."""
    return -(-tokens // block_size) if block_size > 0 else 0


@dataclass(slots=True)
class SideCandidates:
    """Qualifying candidates of one side, and why the others were turned down."""

    side: str
    eligible: list[Candidate] = field(default_factory=list)
    with_role: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> instances
    #: Instances turned down for capacity only (no KV room now; room comes as requests end).
    full: int = 0

    def explain(self, model: str, served: Collection[str]) -> str:
        """The UNAVAILABLE message for this side, e.g. "no decode instance for model m: ...".

        `served` = the model names the view holds (for "no instance serves this model").
        """
        head = f"no {self.side} instance for model {echo(model)}"
        if self.with_role == 0 and not served:
            return f"{head}: no instance serves this model (none registered)"
        if self.with_role == 0 and model not in served:
            return f"{head}: no instance serves this model (served: {', '.join(sorted(served))})"
        if self.with_role == 0:
            return f"{head}: none registered with role {self.side} or both"
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(self.rejected.items()))
        return f"{head}: {self.with_role} registered, all turned down ({why})"

    def require(self, model: str, served: Callable[[], Collection[str]]) -> list[Candidate]:
        """The eligible candidates; raises NoInstance(side) when there are none, its NoRoom
        kind when at least one instance was turned down for KV room only (room may come).

        `served()` is only called to word the error.
        """
        if not self.eligible:
            message = self.explain(model, served())
            if self.full:
                raise NoRoom(self.side, message)
            raise NoInstance(self.side, message)
        return self.eligible


def split_sides(
    candidates: Sequence[Candidate],
    *,
    tokens: int,
    exclude: Collection[str],
    pending_blocks: Callable[[Candidate], int],
    assigned_blocks: Callable[[Candidate], int],
    push_tokens: int | None = None,
) -> tuple[SideCandidates, SideCandidates]:
    """One pass over a model's candidates -> (prefill side, decode side).

    `tokens` = prompt_tokens + max_tokens; `pending_blocks(c)` = KV blocks the scheduler
    already assigned to decode candidate `c` since its last load report, less those freed
    since by requests the report counted (the KV room check); `assigned_blocks(c)` = the same
    without that credit (the push receive-buffer check); `push_tokens` = the prompt tokens a
    push would carry (None: `tokens`).
    """
    prefill, decode = SideCandidates("prefill"), SideCandidates("decode")
    pushed = tokens if push_tokens is None else push_tokens
    no_buffer_room: list[Candidate] = []  # decodes whose receive buffer is full
    # The hot loop of every decision: plain attribute checks, reasons worded only on reject.
    for c in candidates:
        if c.can_prefill:
            prefill.with_role += 1
        if c.can_decode:
            decode.with_role += 1
        if not c.serving or c.max_model_len < tokens or c.instance_id in exclude:
            reason = _common_rejection(c, tokens, exclude)
            if c.can_prefill:
                prefill.rejected[reason] = prefill.rejected.get(reason, 0) + 1
            if c.can_decode:
                decode.rejected[reason] = decode.rejected.get(reason, 0) + 1
            continue
        if c.can_prefill:
            prefill.eligible.append(c)
        if c.can_decode:
            if (
                c.total_kv_blocks
                and c.block_size
                and (c.free_kv_blocks - pending_blocks(c)) * c.block_size < tokens
            ):
                # Room that can never come (a cache smaller than the request) is no capacity
                # refusal: waiting for it would only delay the answer.
                if c.total_kv_blocks * c.block_size < tokens:
                    reason = f"KV cache smaller than {tokens} tokens"
                else:
                    reason = f"no KV room for {tokens} tokens"
                    decode.full += 1
                decode.rejected[reason] = decode.rejected.get(reason, 0) + 1
            elif c.recv_capacity_bytes and not _buffer_room(c, pushed, assigned_blocks):
                no_buffer_room.append(c)
            else:
                decode.eligible.append(c)
    if not decode.eligible:
        decode.eligible = no_buffer_room  # they still serve the request, by pull
    return prefill, decode


def _buffer_room(c: Candidate, tokens: int, assigned_blocks: Callable[[Candidate], int]) -> bool:
    # A push carries the prompt's blocks; what was assigned since the report may be pushed too
    # (releases of requests the report counted free KV room, not buffer room).
    block_bytes = c.kv_block_bytes
    needed = blocks_for(tokens, c.block_size) * block_bytes
    return c.recv_headroom_bytes - assigned_blocks(c) * block_bytes >= needed


def _common_rejection(c: Candidate, tokens: int, exclude: Collection[str]) -> str:
    if not c.serving:
        return "draining"
    if c.instance_id in exclude:
        return "excluded"
    return f"max_model_len < {tokens} tokens"


def pair_keys_of(candidates: Sequence[Candidate]) -> set[PairKey]:
    """The distinct (fingerprint, transport, max_model_len) keys among `candidates`."""
    return {c.pair_key for c in candidates}


def describe_keys(keys: set[PairKey]) -> str:
    """Readable keys for error messages: "L2.H2.D32.B16.float32/TCP/len=2048"."""
    return ", ".join(
        sorted(
            f"{fp}/{instance_pb2.Transport.Name(t).removeprefix('TRANSPORT_')}/len={n}"
            for fp, t, n in keys
        )
    )
