"""The decision: pairing, compatibility filter, decode guard, in-flight spreading, errors."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from pdplane.scheduler.candidate import Candidate
from pdplane.scheduler.decision import Decider
from pdplane.scheduler.errors import InvalidRequest, NoInstance, NoRoom
from pdplane.scheduler.metrics import SchedulerMetrics
from pdplane.scheduler.policies import POLICIES, Pick, PickContext
from pdplane.scheduler.port import RequestFeatures, SchedulerBusy
from pdplane.scheduler.view import CandidateView
from pdplane.v1 import instance_pb2

MakeInstance = Callable[..., instance_pb2.Instance]


@pytest.fixture
def build(fake_source: type) -> Callable[..., tuple[Decider, Any]]:
    def make(*instances: instance_pb2.Instance, **kwargs: Any) -> tuple[Decider, Any]:
        source = fake_source(*instances)
        return Decider(CandidateView(source), **kwargs), source

    return make


def req(n: int = 0, **kwargs: Any) -> RequestFeatures:
    fields: dict[str, Any] = {"request_id": f"r{n}", "model": "tiny", "prompt_tokens": 100}
    return RequestFeatures(**{**fields, **kwargs})


def test_pairs_a_prefill_with_a_decode(build: Callable, make_instance: MakeInstance) -> None:
    service, _ = build(make_instance("p", "prefill"), make_instance("d", "decode"))
    decision = service.schedule(req())
    assert (decision.prefill.instance_id, decision.decode.instance_id) == ("p", "d")
    assert decision.reason.startswith("prefill least_loaded: ") and "; decode least_loaded" in (
        decision.reason
    )


def test_round_robin_alternates_each_side_independently(
    build: Callable, make_instance: MakeInstance
) -> None:
    service, _ = build(
        *(make_instance(f"p{i}", "prefill") for i in range(2)),
        *(make_instance(f"d{i}", "decode") for i in range(3)),
        prefill_policy="round_robin",
        decode_policy="round_robin",
    )
    pairs = [service.schedule(req(i)) for i in range(6)]
    assert [d.prefill.instance_id for d in pairs] == ["p0", "p1"] * 3
    assert [d.decode.instance_id for d in pairs] == ["d0", "d1", "d2"] * 2


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ({"draining": True}, "draining"),
        ({"model": "other"}, "model"),
        ({"max_model_len": 64}, "max_model_len < 116 tokens"),
    ],
)
def test_unfit_instances_are_never_chosen(
    build: Callable, make_instance: MakeInstance, bad: dict[str, Any], why: str
) -> None:
    service, _ = build(
        make_instance("p-good", "prefill"),
        make_instance("p-bad", "prefill", **bad),
        make_instance("d-good", "decode"),
        make_instance("d-bad", "decode", **bad),
        prefill_policy="round_robin",
        decode_policy="round_robin",
    )
    for i in range(10):
        decision = service.schedule(req(i, max_tokens=16))
        assert (decision.prefill.instance_id, decision.decode.instance_id) == ("p-good", "d-good")


def test_layout_transport_and_length_must_match_across_the_pair(
    build: Callable, make_instance: MakeInstance
) -> None:
    service, source = build(
        make_instance("p", "prefill", dtype="bfloat16"),
        make_instance("d-fp32", "decode", dtype="float32"),
        make_instance("d-nccl", "decode", dtype="bfloat16", transport=instance_pb2.TRANSPORT_NCCL),
        make_instance("d-len", "decode", dtype="bfloat16", max_model_len=4096),
    )
    with pytest.raises(NoInstance) as err:
        service.schedule(req())
    assert err.value.side == "pair"
    assert "no compatible prefill/decode pair for model 'tiny'" in str(err.value)
    assert "B16.bfloat16/TCP/len=2048" in str(err.value)
    source.put(make_instance("d-ok", "decode", dtype="bfloat16"))
    assert service.schedule(req()).decode.instance_id == "d-ok"


def test_exclusions_are_respected(build: Callable, make_instance: MakeInstance) -> None:
    service, _ = build(
        make_instance("p1", "prefill"),
        make_instance("p2", "prefill"),
        make_instance("d1", "decode"),
        make_instance("d2", "decode"),
    )
    decision = service.schedule(req(exclude_instance_ids={"p1", "d1"}))
    assert (decision.prefill.instance_id, decision.decode.instance_id) == ("p2", "d2")
    with pytest.raises(NoInstance, match=r"no decode instance .*\(2 excluded\)"):
        service.schedule(req(exclude_instance_ids={"d1", "d2"}))


def test_only_decode_names_the_missing_prefill_then_serves_once_it_registers(
    build: Callable, make_instance: MakeInstance
) -> None:
    service, source = build(make_instance("d", "decode"))
    with pytest.raises(NoInstance, match="no prefill instance for model 'tiny'") as err:
        service.schedule(req())
    assert err.value.side == "prefill"
    source.put(make_instance("p", "prefill"))
    assert service.schedule(req()).prefill.instance_id == "p"


def test_only_prefill_names_the_missing_decode(
    build: Callable, make_instance: MakeInstance
) -> None:
    service, _ = build(make_instance("p", "prefill"), make_instance("d", "decode", draining=True))
    with pytest.raises(NoInstance, match=r"no decode instance for model 'tiny': .*1 draining"):
        service.schedule(req())


def test_unknown_model_lists_the_served_ones(build: Callable, make_instance: MakeInstance) -> None:
    service, _ = build(make_instance("p", "prefill", model="a"), make_instance("d", "decode"))
    with pytest.raises(NoInstance, match=r"no instance serves this model \(served: a, tiny\)"):
        service.schedule(req(model="b"))


def test_decode_guard_skips_decodes_without_kv_room(
    build: Callable, make_instance: MakeInstance
) -> None:
    # block_size 16: the request needs 100 + 28 = 128 tokens = 8 blocks.
    service, _ = build(
        make_instance("p", "prefill"),
        make_instance("d-full", "decode", free_kv_blocks=7, total_kv_blocks=100),
        make_instance("d-room", "decode", free_kv_blocks=8, total_kv_blocks=100, num_running=50),
        make_instance("d-unreported", "decode", num_running=60),  # no KV numbers: no guard
    )
    assert service.schedule(req(1, max_tokens=28)).decode.instance_id == "d-room"
    # d-room's 8 free blocks are now reserved for r1 until its next report.
    assert service.schedule(req(2, max_tokens=28)).decode.instance_id == "d-unreported"


def test_decode_guard_reports_no_room(build: Callable, make_instance: MakeInstance) -> None:
    service, _ = build(
        make_instance("p", "prefill"),
        make_instance("d", "decode", free_kv_blocks=1, total_kv_blocks=100),
    )
    with pytest.raises(NoInstance, match=r"no decode instance .*1 no KV room for 100 tokens"):
        service.schedule(req())


@pytest.mark.parametrize("policy", ["least_loaded", "power_of_two"])
def test_a_burst_between_heartbeats_spreads(
    build: Callable, make_instance: MakeInstance, policy: str
) -> None:
    service, _ = build(
        *(make_instance(f"p{i}", "prefill") for i in range(2)),
        *(make_instance(f"d{i}", "decode") for i in range(4)),
        prefill_policy=policy,
        decode_policy=policy,
        seed=1,
    )
    decisions = [service.schedule(req(i)) for i in range(100)]
    prefills = Counter(d.prefill.instance_id for d in decisions)
    decodes = Counter(d.decode.instance_id for d in decisions)
    if policy == "least_loaded":
        assert prefills == {"p0": 50, "p1": 50}
        assert decodes == {f"d{i}": 25 for i in range(4)}
    else:
        assert max(prefills.values()) - min(prefills.values()) <= 10
        assert len(decodes) == 4 and max(decodes.values()) <= 40


def test_release_frees_load_and_a_heartbeat_restarts_the_count(
    build: Callable, make_instance: MakeInstance
) -> None:
    service, source = build(
        make_instance("p", "prefill"),
        make_instance("d0", "decode", revision=1),
        make_instance("d1", "decode", revision=1),
    )
    assert service.schedule(req(1)).decode.instance_id == "d0"
    assert service.schedule(req(2)).decode.instance_id == "d1"
    assert service.release("r1", "success") is True
    assert service.schedule(req(3)).decode.instance_id == "d0"
    # d1's next heartbeat reports its work: the scheduler stops adding its own count.
    source.put(make_instance("d1", "decode", revision=2, num_running=0))
    source.put(make_instance("d0", "decode", revision=2, num_running=1))
    assert service.schedule(req(4)).decode.instance_id == "d1"


def test_a_both_instance_pairs_with_another_decode_before_itself(
    build: Callable, make_instance: MakeInstance
) -> None:
    service, source = build(make_instance("b", "both"))
    decision = service.schedule(req())
    assert (decision.prefill.instance_id, decision.decode.instance_id) == ("b", "b")
    source.put(make_instance("d", "decode", num_running=5))
    decision = service.schedule(req(2))
    assert decision.prefill.instance_id == "b" and decision.decode.instance_id == "d"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"request_id": ""}, "request_id: must not be empty"),
        ({"request_id": "x" * 2000}, "request_id: longer than"),
        ({"model": ""}, "model: must not be empty"),
        ({"prompt_tokens": 0}, "prompt_tokens: must be > 0"),
        ({"prompt_tokens": -5}, "prompt_tokens: must be > 0"),
        ({"max_tokens": -1}, "max_tokens: must be >= 0"),
        ({"prefill_policy": "fastest"}, "prefill_policy: unknown policy 'fastest'"),
        ({"decode_policy": "nope"}, "decode_policy: unknown policy 'nope'"),
    ],
)
def test_bad_requests_are_invalid(
    build: Callable, make_instance: MakeInstance, fields: dict[str, Any], message: str
) -> None:
    service, _ = build(make_instance("p", "prefill"), make_instance("d", "decode"))
    with pytest.raises(InvalidRequest, match=message):
        service.schedule(req(**fields))
    assert len(service.inflight) == 0


def test_per_request_policy_override(build: Callable, make_instance: MakeInstance) -> None:
    service, _ = build(
        make_instance("p0", "prefill"),
        make_instance("p1", "prefill", num_running=9),
        make_instance("d", "decode"),
        prefill_policy="least_loaded",
    )
    picked = [service.schedule(req(i, prefill_policy="round_robin")) for i in range(2)]
    assert [d.prefill.instance_id for d in picked] == ["p0", "p1"]
    assert service.schedule(req(9)).prefill.instance_id == "p0"


def test_policies_see_the_prompts_exact_block_hashes_and_length(
    build: Callable, make_instance: MakeInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[PickContext] = []

    class Spy:
        name = "spy"

        def pick(self, candidates: Sequence[Candidate], ctx: PickContext) -> Pick:
            seen.append(ctx)
            return Pick(candidates[0], "spy")

    monkeypatch.setitem(POLICIES, "spy", lambda seed=None: Spy())
    service, _ = build(
        make_instance("p", "prefill"), make_instance("d", "decode"), prefill_policy="spy"
    )
    service.schedule(req(prompt_tokens=40, prefix_hashes={16: (1, 2), 32: (3,)}))
    ctx = seen[0]
    assert (ctx.prompt_tokens, ctx.block_hashes(16), ctx.block_hashes(32)) == (40, (1, 2), (3,))
    assert ctx.block_hashes(128) == ()
    # consistent_hash's key when the request names no prefix_block_hashes of its own.
    assert ctx.prefix_block_hashes == (1, 2)
    service.schedule(req(1, prefix_block_hashes=(7,), prefix_hashes={16: (1,)}))
    assert seen[1].prefix_block_hashes == (7,)


def test_consistent_hash_keys_on_the_exact_prefix_hashes(
    build: Callable, make_instance: MakeInstance
) -> None:
    service, _ = build(
        *(make_instance(f"p{i}", "prefill") for i in range(4)),
        make_instance("d", "decode"),
        prefill_policy="consistent_hash",
    )
    picks = {
        service.schedule(req(i, prefix_hashes={16: (11, 12, i % 1)})).prefill.instance_id
        for i in range(4)
    }
    assert len(picks) == 1
    assert "consistent_hash: by prefix" in service.schedule(req(9, prefix_hashes={16: (5,)})).reason


@pytest.mark.parametrize(
    ("prefix_hashes", "message"),
    [
        ({0: (1,)}, "block_size must be > 0"),
        ({16: tuple(range(7))}, "7 blocks of 16 tokens exceed prompt_tokens=100"),
    ],
)
def test_prefix_hashes_must_fit_the_prompt(
    build: Callable, make_instance: MakeInstance, prefix_hashes: dict, message: str
) -> None:
    service, _ = build(make_instance("p", "prefill"), make_instance("d", "decode"))
    with pytest.raises(InvalidRequest, match=message):
        service.schedule(req(prefix_hashes=prefix_hashes))


def test_unknown_default_policy_is_rejected_at_construction(fake_source: type) -> None:
    with pytest.raises(ValueError, match="unknown policy 'x'"):
        Decider(CandidateView(fake_source()), decode_policy="x")


def test_release_of_unknown_or_empty_id(build: Callable) -> None:
    service, _ = build()
    assert service.release("ghost", "cancelled") is False
    with pytest.raises(InvalidRequest):
        service.release("", "success")


def test_metrics_count_decisions_unavailable_and_releases(
    build: Callable, make_instance: MakeInstance
) -> None:
    metrics = SchedulerMetrics()
    service, source = build(make_instance("d", "decode"), metrics=metrics)
    metrics.watch(service.inflight.inflight_by_instance, service.view.all)
    with pytest.raises(NoInstance):
        service.schedule(req())
    source.put(make_instance("p", "prefill"))
    service.schedule(req(1))
    service.release("ghost", "failed")
    value = metrics.registry.get_sample_value
    assert value("pdplane_scheduler_unavailable_total", {"side": "prefill"}) == 1
    labels = {"prefill_policy": "least_loaded", "decode_policy": "least_loaded"}
    assert value("pdplane_scheduler_decisions_total", labels) == 1
    assert value("pdplane_scheduler_decision_seconds_count") == 1
    assert value("pdplane_scheduler_releases_total", {"outcome": "failed", "known": "false"}) == 1
    assert value("pdplane_scheduler_inflight_requests", {"instance_id": "d"}) == 1
    assert value("pdplane_scheduler_instances", {"role": "prefill", "state": "serving"}) == 1


def test_unreleased_assignments_stop_reserving_kv_room_after_the_reservation_window(
    build: Callable, make_instance: MakeInstance
) -> None:
    """512 Schedules never released (no token needed) must not starve the decode for the
    600 s in-flight timeout: once `reservation_s` passed without the decode's report showing
    them, they stop reserving its KV room (they stay in flight until released or expired)."""
    from pdplane.scheduler.inflight import InflightTracker

    now = [100.0]
    tracker = InflightTracker(timeout_s=600.0, reservation_s=5.0, clock=lambda: now[0])
    service, _ = build(
        make_instance("p", "prefill"),
        make_instance("d", "decode", free_kv_blocks=1000, total_kv_blocks=1000),
        inflight=tracker,
    )
    flood = 0
    with pytest.raises(NoInstance, match="no KV room"):
        for flood in range(512):
            service.schedule(req(flood, max_tokens=28))  # 8 blocks each
    assert flood == 125  # 125 * 8 = 1,000 blocks reserved, the 126th has no room
    now[0] += 4.0
    with pytest.raises(NoInstance, match="no KV room"):
        service.schedule(req(1000, max_tokens=28))  # still inside the window
    now[0] += 1.5
    assert service.schedule(req(1001, max_tokens=28)).decode.instance_id == "d"
    assert len(tracker) == 126  # counted in flight still, releasable
    assert tracker.release("r0") is not None


def test_no_kv_room_is_a_capacity_refusal(build: Callable, make_instance: MakeInstance) -> None:
    metrics = SchedulerMetrics()
    service, _ = build(
        make_instance("p", "prefill"),
        make_instance("d", "decode", free_kv_blocks=1, total_kv_blocks=100),
        make_instance("d-draining", "decode", draining=True),
        metrics=metrics,
    )
    with pytest.raises(NoRoom, match=r"1 draining, 1 no KV room for 100 tokens") as info:
        service.schedule(req())
    assert isinstance(info.value, SchedulerBusy) and info.value.side == "decode"
    value = metrics.registry.get_sample_value
    assert value("pdplane_scheduler_no_room_total", {"side": "decode"}) == 1
    assert value("pdplane_scheduler_unavailable_total", {"side": "decode"}) is None


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"free_kv_blocks": 1, "total_kv_blocks": 6}, "1 KV cache smaller than 100 tokens"),
        ({"draining": True}, "1 draining"),
    ],
)
def test_room_that_cannot_come_is_no_capacity_refusal(
    build: Callable, make_instance: MakeInstance, extra: dict[str, Any], why: str
) -> None:
    # block_size 16: 100 tokens need 7 blocks; a 6-block cache never holds them.
    service, _ = build(make_instance("p", "prefill"), make_instance("d", "decode", **extra))
    with pytest.raises(NoInstance, match=why) as info:
        service.schedule(req())
    assert not isinstance(info.value, SchedulerBusy)
