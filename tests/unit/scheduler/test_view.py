"""The candidate view: grouping, lazy refresh, per-instance reuse."""

from __future__ import annotations

from collections.abc import Callable

from pdplane.scheduler.view import CandidateView
from pdplane.v1 import instance_pb2


def test_groups_by_model_sorted_by_id(
    fake_source: type, make_instance: Callable[..., instance_pb2.Instance]
) -> None:
    source = fake_source(
        make_instance("b", model="m1"),
        make_instance("a", model="m1"),
        make_instance("c", model="m2"),
    )
    view = CandidateView(source)
    assert [c.instance_id for c in view.candidates("m1")] == ["a", "b"]
    assert view.models() == ["m1", "m2"]
    assert view.candidates("nope") == ()


def test_rereads_only_when_the_revision_moves_and_a_heartbeat_by_its_change_alone(
    fake_source: type, make_instance: Callable[..., instance_pb2.Instance]
) -> None:
    source = fake_source(make_instance("a", revision=1), make_instance("b", revision=1))
    view = CandidateView(source)
    first = view.candidates("tiny")
    view.candidates("tiny")
    assert (source.snapshots, source.log_reads) == (1, 1)
    source.put(make_instance("b", revision=2, num_running=4))
    second = view.candidates("tiny")
    # The change log says what moved: no copy of the whole view.
    assert (source.snapshots, source.log_reads) == (1, 2)
    assert second[0] is first[0]  # unchanged instance: same Candidate object
    assert second[1].num_running == 4
    source.remove("a")  # instances came or went: regrouped from a snapshot
    assert [c.instance_id for c in view.candidates("tiny")] == ["b"]
    assert source.snapshots == 2


def test_a_source_without_a_change_log_is_reread_whole(
    make_instance: Callable[..., instance_pb2.Instance],
) -> None:
    class Plain:
        def __init__(self) -> None:
            self.revision = 1
            self.instances = {"a": make_instance("a"), "b": make_instance("b", "decode")}

        def snapshot(self) -> dict[str, instance_pb2.Instance]:
            return dict(self.instances)

    source = Plain()
    view = CandidateView(source)
    assert [c.num_running for c in view.candidates("tiny")] == [0, 0]
    source.instances["b"] = make_instance("b", "decode", num_running=2)
    source.revision = 2
    assert [c.num_running for c in view.candidates("tiny")] == [0, 2]


def test_mark_dirty_forces_a_reread(
    fake_source: type, make_instance: Callable[..., instance_pb2.Instance]
) -> None:
    source = fake_source(make_instance("a"))
    view = CandidateView(source)
    view.candidates("tiny")
    view.mark_dirty({})
    view.candidates("tiny")
    assert source.log_reads == 2


def test_knows_when_a_model_has_a_single_pair_key(
    fake_source: type, make_instance: Callable[..., instance_pb2.Instance]
) -> None:
    source = fake_source(make_instance("a", model="m1"), make_instance("b", "decode", model="m1"))
    source.put(make_instance("c", model="m2"), make_instance("d", model="m2", dtype="bfloat16"))
    view = CandidateView(source)
    view.candidates("m1")
    assert view.is_uniform("m1") and not view.is_uniform("m2")


def test_updates_in_place_and_regroups_when_model_or_layout_change(
    fake_source: type, make_instance: Callable[..., instance_pb2.Instance]
) -> None:
    source = fake_source(*(make_instance(i, model="m1") for i in ("a", "b", "c")))
    view = CandidateView(source)
    view.candidates("m1")
    source.put(make_instance("b", model="m1", num_waiting=3))  # a heartbeat: patched in place
    assert [(c.instance_id, c.num_waiting) for c in view.candidates("m1")] == [
        ("a", 0),
        ("b", 3),
        ("c", 0),
    ]
    source.put(make_instance("c", model="m1", dtype="bfloat16"))  # new layout: regrouped
    view.candidates("m1")
    assert not view.is_uniform("m1")
    source.put(make_instance("a", model="m2"))  # moved to another model
    assert [c.instance_id for c in view.candidates("m1")] == ["b", "c"]
    assert [c.instance_id for c in view.candidates("m2")] == ["a"]
    source.put(make_instance("d", model="m2"), make_instance("b", model="m1", num_running=1))
    assert [c.instance_id for c in view.candidates("m2")] == ["a", "d"]
    assert view.candidates("m1")[0].num_running == 1
