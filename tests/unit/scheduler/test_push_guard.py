"""The decode guard in push mode: a decode whose receive buffer cannot take the prompt's KV is
picked only when no decode with room is left (its push would be refused; it still serves the
request by pull)."""

from __future__ import annotations

from collections.abc import Callable

from pdplane.scheduler.candidate import Candidate
from pdplane.scheduler.compat import split_sides
from pdplane.scheduler.table import ModelTables

BLOCK = 1 << 20  # bytes of one KV cache block (all layers), as the load report says
MakeCandidate = Callable[..., Candidate]


def _decode(make_candidate: MakeCandidate, name: str, headroom_blocks: int) -> Candidate:
    return make_candidate(
        name,
        "decode",
        recv_buffer_capacity_bytes=64 * BLOCK,
        recv_buffer_headroom_bytes=headroom_blocks * BLOCK,
        kv_block_bytes=BLOCK,
    )


class _Assigned:
    """In-flight counts of a tracker that assigned `blocks` KV blocks to every decode since
    its report (pending and assigned alike)."""

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks

    def counts(self, candidate: Candidate, decode: bool) -> tuple[int, int, int, int, int, float]:
        return 0, self.blocks, self.blocks, 0, 0, 0.0

    def busy_until(self, instance_id: str) -> float:
        return 0.0

    def unseen_count(self, instance_id: str) -> int:
        return 0


def _eligible(candidates: list[Candidate], push_tokens: int, pending: int = 0) -> list[str]:
    tables = ModelTables(candidates)
    tables.decode.write_all(_Assigned(pending))  # type: ignore[arg-type]
    _, decode = split_sides(tables, tokens=push_tokens + 64, exclude=(), push_tokens=push_tokens)
    return [tables.decode.candidates[row].instance_id for row in decode.rows]


def test_a_full_receive_buffer_is_set_aside(make_candidate: MakeCandidate) -> None:
    # block_size 16: a 100-token prompt is 7 blocks of KV
    full, room = _decode(make_candidate, "d-full", 6), _decode(make_candidate, "d-room", 7)
    assert _eligible([full, room], push_tokens=100) == ["d-room"]


def test_blocks_assigned_since_the_report_count_against_the_buffer(
    make_candidate: MakeCandidate,
) -> None:
    room = _decode(make_candidate, "d", 10)
    pull_only = make_candidate("d-pull", "decode")  # capacity 0: takes no pushes, no guard
    assert _eligible([room, pull_only], push_tokens=100, pending=3) == ["d", "d-pull"]
    assert _eligible([room, pull_only], push_tokens=100, pending=4) == ["d-pull"]


def test_with_every_buffer_full_the_decodes_still_serve_by_pull(
    make_candidate: MakeCandidate,
) -> None:
    full = [_decode(make_candidate, f"d{i}", 0) for i in range(2)]
    assert _eligible(full, push_tokens=100) == ["d0", "d1"]


def test_unknown_block_bytes_disable_the_check(make_candidate: MakeCandidate) -> None:
    d = make_candidate(
        "d", "decode", recv_buffer_capacity_bytes=BLOCK, recv_buffer_headroom_bytes=0
    )
    other = _decode(make_candidate, "d-room", 64)
    assert _eligible([d, other], push_tokens=100) == ["d", "d-room"]
