"""Which registered instances a worker pre-connects to and drops (peer_watch.PeerWatch)."""

from __future__ import annotations

from typing import Any

from pdplane.connector.peer_watch import PeerWatch, WorkerIdentity, rendezvous_order
from pdplane.connector.transports.base import PeerInstance
from pdplane.core.instance.layout import fingerprint
from pdplane.v1 import instance_pb2
from tests.integration.registry.fixtures import make_spec

LAYOUT = make_spec().kv_layout
SERVING, DRAINING = instance_pb2.INSTANCE_STATE_SERVING, instance_pb2.INSTANCE_STATE_DRAINING
PREFILL, DECODE, BOTH = instance_pb2.ROLE_PREFILL, instance_pb2.ROLE_DECODE, instance_pb2.ROLE_BOTH


def _inst(instance_id: str, role: int, state: int = SERVING, **spec: Any) -> instance_pb2.Instance:
    return instance_pb2.Instance(spec=make_spec(instance_id, role, **spec), state=state)


def _view(*instances: instance_pb2.Instance) -> dict[str, instance_pb2.Instance]:
    return {i.spec.instance_id: i for i in instances}


def _watch(role: int, limit: int = 8, push: bool = False) -> tuple[PeerWatch, list, list]:
    me = WorkerIdentity(
        "me", role, "tiny", instance_pb2.TRANSPORT_TCP, fingerprint(LAYOUT), 1, push=push
    )
    connected: list[list[PeerInstance]] = []
    gone: list[PeerInstance] = []
    return PeerWatch(me, connected.append, gone.append, limit), connected, gone


def test_a_decode_pulls_from_compatible_prefills_only() -> None:
    watch, _, _ = _watch(DECODE)
    other_layout = instance_pb2.KvLayout()
    other_layout.CopyFrom(LAYOUT)
    other_layout.block_size = 32
    peers = watch.initial(
        _view(
            _inst("p0", PREFILL),
            _inst("b0", BOTH),
            _inst("d1", DECODE),  # same role: never
            _inst("me", PREFILL),  # itself
            _inst("p-model", PREFILL, model="other"),
            _inst("p-layout", PREFILL, kv_layout=other_layout),
            _inst("p-tp2", PREFILL, tp_size=2),
            _inst("p-nccl", PREFILL, transport=instance_pb2.TRANSPORT_NCCL),
        )
    )
    assert sorted(p.instance_id for p in peers) == ["b0", "p0"]
    assert all(p.pulls_from and not p.serves_to for p in peers)


def test_a_prefill_serves_decodes_and_pushes_to_them_in_push_mode() -> None:
    watch, _, _ = _watch(PREFILL, push=True)
    (peer,) = watch.initial(_view(_inst("d0", DECODE), _inst("p1", PREFILL)))
    assert (peer.instance_id, peer.serves_to, peer.pushes_to, peer.pulls_from) == (
        "d0",
        True,
        True,
        False,
    )


def test_pre_connect_is_bounded_and_spread_by_rendezvous_order() -> None:
    prefills = [_inst(f"p{i}", PREFILL) for i in range(10)]
    watch, _, _ = _watch(DECODE, limit=3)
    chosen = [p.instance_id for p in watch.initial(_view(*prefills))]
    assert chosen == rendezvous_order("me", [f"p{i}" for i in range(10)])[:3]
    other = rendezvous_order("someone-else", [f"p{i}" for i in range(10)])[:3]
    assert other != chosen  # another decode starts elsewhere


def test_later_arrivals_are_pre_connected_while_room_is_left() -> None:
    watch, connected, _ = _watch(DECODE, limit=2)
    assert [p.instance_id for p in watch.initial(_view(_inst("p0", PREFILL)))] == ["p0"]
    watch.on_change(_view(_inst("p0", PREFILL), _inst("p1", PREFILL), _inst("p2", PREFILL)))
    assert [[p.instance_id for p in batch] for batch in connected] == [
        [rendezvous_order("me", ["p1", "p2"])[0]]
    ]


def test_a_draining_instance_is_not_pre_connected_and_is_dropped_once_removed() -> None:
    watch, connected, gone = _watch(DECODE)
    assert watch.initial(_view(_inst("p0", PREFILL, DRAINING))) == []
    watch.on_change(_view(_inst("p0", PREFILL, DRAINING)))
    assert connected == [] and gone == []
    watch.on_change(_view())
    assert [p.instance_id for p in gone] == ["p0"] and watch.gone == 1


def test_a_peer_that_leaves_is_reported_once_and_frees_its_place() -> None:
    watch, connected, gone = _watch(DECODE, limit=1)
    first = watch.initial(_view(_inst("p0", PREFILL), _inst("p1", PREFILL)))
    (kept,) = first
    other = "p1" if kept.instance_id == "p0" else "p0"
    watch.on_change(_view(_inst(other, PREFILL)))  # the chosen one left
    watch.on_change(_view(_inst(other, PREFILL)))
    assert [p.instance_id for p in gone] == [kept.instance_id]
    assert [[p.instance_id for p in batch] for batch in connected] == [[other]]


def test_changes_before_the_first_view_are_ignored() -> None:
    watch, connected, gone = _watch(DECODE)
    watch.on_change(_view(_inst("p0", PREFILL)))
    assert connected == [] and gone == []
