"""kv_aware's choices over a prefix index filled by hand, its predicted queues, and conditional
disaggregation (on a clock the tests move)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from pdplane.core.prefix_hash import block_hashes
from pdplane.scheduler.decision import Decider
from pdplane.scheduler.inflight import InflightTracker
from pdplane.scheduler.kv_index import KvState, PrefixIndex
from pdplane.scheduler.latency import LatencyModel
from pdplane.scheduler.metrics import SchedulerMetrics
from pdplane.scheduler.policies.kv_aware import KvAwareWeights
from pdplane.scheduler.port import Decision, RequestFeatures
from pdplane.scheduler.view import CandidateView
from pdplane.scheduler.wire import decision_from_pb, decision_to_pb
from pdplane.v1 import kv_events_pb2, scheduler_pb2
from tests.unit.scheduler.helpers import (
    BS,
    Clock,
    MakeInstance,
    engine_hashes,
    hold,
    req,
    tokens,
)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def fleet(fake_source: type, make_instance: MakeInstance, clock: Clock) -> Callable[..., Decider]:
    """2 prefill + 2 decode, kv_aware both sides (the default profile), an empty prefix index,
    the tracker on `clock`."""

    def make(loads: dict[str, dict[str, Any]] | None = None, **kwargs: Any) -> Decider:
        loads = loads or {}
        instances = [
            make_instance(name, role, **loads.get(name, {}))
            for name, role in (
                ("p0", "prefill"),
                ("p1", "prefill"),
                ("d0", "decode"),
                ("d1", "decode"),
            )
        ]
        kwargs.setdefault("local_prefill_max_tokens", 0)
        kwargs.setdefault("inflight", InflightTracker(clock=clock))
        service = Decider(
            CandidateView(fake_source(*instances)),
            prefill_policy="kv_aware",
            decode_policy="kv_aware",
            **kwargs,
        )
        service.kv_index = PrefixIndex()
        return service

    return make


def test_prefill_goes_where_the_prefix_is_cached(fleet: Callable[..., Decider]) -> None:
    service = fleet()
    shared = tokens(0, 20 * BS)
    hold(service.kv_index, "p1", shared)  # type: ignore[arg-type]
    for i in range(4):
        decision = service.schedule(req(i, shared + tokens(100 + i, 40)))
        service.release(f"r{i}", "success")  # done: so is its prefill, p1's queue is empty
        assert decision.prefill is not None and decision.prefill.instance_id == "p1"
        assert decision.prefill_cached_tokens == 20 * BS
        assert f"prefill kv_aware: cached={20 * BS}/{20 * BS + 40} tokens" in decision.reason


def test_the_longest_prefix_wins(fleet: Callable[..., Decider]) -> None:
    service = fleet()
    prompt = tokens(1, 16 * BS)
    hold(service.kv_index, "p0", prompt[: 4 * BS])  # type: ignore[arg-type]
    hold(service.kv_index, "p1", prompt[: 12 * BS])  # type: ignore[arg-type]
    decision = service.schedule(req(0, prompt))
    assert decision.prefill is not None and decision.prefill.instance_id == "p1"
    assert decision.prefill_cached_tokens == 12 * BS


def test_a_holder_whose_queue_outlasts_the_saving_loses_to_an_idle_instance(
    fleet: Callable[..., Decider], clock: Clock
) -> None:
    # A 1,600-token shared prefix saves ~48 ms of prefill (default profile); the holder
    # takes the burst until its predicted queue is longer than that, then the idle one gets
    # the next prompt whole.
    service = fleet()
    shared = tokens(3, 100 * BS)
    hold(service.kv_index, "p0", shared)  # type: ignore[arg-type]
    picks = []
    for i in range(40):  # no release, no new load report: only the predicted queue sees it
        decision = service.schedule(req(i, shared + tokens(200 + i, 160)))
        assert decision.prefill is not None
        picks.append(decision.prefill.instance_id)
    counts = Counter(picks)
    assert picks[:3] == ["p0"] * 3  # the holder takes the first ones
    assert counts["p1"] > 0 and counts["p0"] > counts["p1"], counts
    model = service.latency
    busy = service.inflight.busy_until
    # What each has queued matches what the model says its prompts take: the first a whole
    # step, each one after it its share of a step.
    p0_work = model.idle_s(160, 100 * BS) + (counts["p0"] - 1) * model.queue_s(160, 100 * BS)
    assert busy("p0") == pytest.approx(clock.now + p0_work)
    # Time passes: both queues drain, and the holder gets the next prompt again.
    clock.now += 10.0
    decision = service.schedule(req(99, shared + tokens(300, 160)))
    assert decision.prefill is not None and decision.prefill.instance_id == "p0"


def test_a_prompt_keeps_an_idle_prefill_busy_for_its_whole_step(
    fleet: Callable[..., Decider], clock: Clock
) -> None:
    # p0 holds the prefix, p1 all of it but the last block. A prompt's step on idle p0 (its
    # fixed part and weight reads included: ~8 ms here, most of it not the prompt's own
    # tokens) is still running half way through, so a prompt sent then goes to p1, which
    # computes one block more at once rather than wait. Counting only the prompt's share of a
    # step (what it adds to a busy queue) had let the second prompt queue behind the first
    # while p1 idled (long-output's TTFT p99 at 8P16D).
    service = fleet()
    shared = tokens(5, 100 * BS)
    hold(service.kv_index, "p0", shared)  # type: ignore[arg-type]
    hold(service.kv_index, "p1", shared[: 99 * BS])  # type: ignore[arg-type]
    model = service.latency
    step_s = (model.step_ms(0.0, 0.0, 100, 100 * BS) + model.coefficients[7]) * 1e-3
    first = service.schedule(req(0, shared + tokens(600, 100)))
    assert first.prefill is not None and first.prefill.instance_id == "p0"
    assert service.inflight.busy_until("p0") == pytest.approx(clock.now + step_s)
    clock.now += step_s / 2
    second = service.schedule(req(1, shared + tokens(601, 100)))
    assert second.prefill is not None and second.prefill.instance_id == "p1"
    # Once that step is over, p0 is the better again.
    clock.now += step_s
    third = service.schedule(req(2, shared + tokens(602, 100)))
    assert third.prefill is not None and third.prefill.instance_id == "p0"


def test_a_prompt_whose_api_server_time_outlasts_the_queue_waits_for_nothing(
    fleet: Callable[..., Decider], clock: Clock
) -> None:
    # tiny-cpu's API server takes 5.88 ms per request before the engine sees it. A prompt
    # sent while p0's step has less than that left reaches the engine after the step: no
    # wait, so p0 (the longer hit) still wins, and it keeps p0 busy for a whole step of its
    # own from its arrival there.
    service = fleet(kv_profile="tiny-cpu")
    shared = tokens(6, 100 * BS)
    hold(service.kv_index, "p0", shared)  # type: ignore[arg-type]
    hold(service.kv_index, "p1", shared[: 99 * BS])  # type: ignore[arg-type]
    model = service.latency
    api_s = model.coefficients[7] * 1e-3
    assert api_s > 0.005
    first = service.schedule(req(0, shared + tokens(700, 100)))
    assert first.prefill is not None and first.prefill.instance_id == "p0"
    clock.now = service.inflight.busy_until("p0") - api_s / 2  # half the API time left
    second = service.schedule(req(1, shared + tokens(701, 100)))
    assert second.prefill is not None and second.prefill.instance_id == "p0"
    assert "(queue 3)" in second.reason, second.reason
    assert service.inflight.busy_until("p0") == pytest.approx(
        clock.now + model.idle_s(100, 100 * BS)
    )


def test_without_hits_prompts_go_to_the_shortest_predicted_queue(
    fleet: Callable[..., Decider],
) -> None:
    # No index entries: prefill by predicted queue, so a long prompt's instance is avoided
    # until the other has as much work queued.
    service = fleet()
    first = service.schedule(req(0, tokens(20, 1500)))
    assert first.prefill is not None
    followers = [service.schedule(req(i, tokens(20 + i, 100))) for i in range(1, 6)]
    other = {"p0": "p1", "p1": "p0"}[first.prefill.instance_id]
    assert all(d.prefill is not None and d.prefill.instance_id == other for d in followers)


def test_an_idle_report_clears_a_predicted_queue_and_a_busy_one_raises_it(
    fake_source: type, make_instance: MakeInstance, clock: Clock
) -> None:
    source = fake_source(make_instance("p0", "prefill"), make_instance("d0", "decode"))
    service = Decider(
        CandidateView(source),
        prefill_policy="kv_aware",
        decode_policy="kv_aware",
        inflight=InflightTracker(clock=clock),
    )
    for i in range(3):
        service.schedule(req(i, tokens(30 + i, 1000)))
    queued = service.inflight.busy_until("p0") - clock.now
    model = service.latency
    assert queued == pytest.approx(model.idle_s(1000) + 2 * model.queue_s(1000))
    clock.now += 0.001
    source.put(make_instance("p0", "prefill", revision=2))  # nothing running or waiting
    service.schedule(req(3, tokens(40, 10)))  # reads the report
    assert service.inflight.busy_until("p0") < clock.now + queued / 2
    # A report of 4 waiting prompts the scheduler never sent (another scheduler's).
    clock.now += 1.0
    source.put(make_instance("p0", "prefill", revision=3, num_waiting=4))
    service.schedule(req(4, tokens(41, 10)))
    assert service.inflight.busy_until("p0") > clock.now + 3 * service.latency.queue_s(10)


def test_the_profile_sets_the_predictions(fleet: Callable[..., Decider]) -> None:
    gpu = fleet()
    cpu = fleet(kv_profile="tiny-cpu")
    assert isinstance(cpu.latency, LatencyModel) and cpu.latency.name == "tiny-cpu"
    prompt = tokens(5, 300)
    fast, slow = gpu.schedule(req(0, prompt)), cpu.schedule(req(0, prompt))
    # Each as its model predicts: one step of 300 tokens, after the API server's time.
    for service, decision in ((gpu, fast), (cpu, slow)):
        model = service.latency
        ms = model.profile.cost.request_ms + model.step_ms(0, 0, 300)
        assert f"KV in {ms:.0f} ms" in decision.reason, decision.reason
    assert cpu.latency.step_ms(0, 0, 300) != gpu.latency.step_ms(0, 0, 300)
    with pytest.raises(ValueError, match="unknown profile"):
        fleet(kv_profile="no-such-profile")


def test_stale_instances_are_routed_by_load_only(fleet: Callable[..., Decider]) -> None:
    service = fleet()
    prompt = tokens(6, 16 * BS)
    hold(service.kv_index, "p1", prompt, live=False)  # type: ignore[arg-type]
    picks = Counter()
    for i in range(4):
        decision = service.schedule(req(i, prompt))
        service.release(f"r{i}", "success")
        assert decision.prefill is not None
        picks[decision.prefill.instance_id] += 1
        assert decision.prefill_cached_tokens == 0
        assert "(0 live)" in decision.reason
    assert picks == {"p0": 2, "p1": 2}  # equal predictions: taken in turn, the cache ignored


def test_without_an_index_it_routes_by_predicted_queue_and_step(
    fake_source: type, make_instance: MakeInstance, clock: Clock
) -> None:
    service = Decider(
        CandidateView(
            fake_source(
                make_instance("p0", "prefill"),
                make_instance("p1", "prefill"),
                make_instance("d0", "decode", num_running=30),
                make_instance("d1", "decode", num_running=2),
            )
        ),
        prefill_policy="kv_aware",
        decode_policy="kv_aware",
        inflight=InflightTracker(clock=clock),
    )
    first = service.schedule(RequestFeatures("r0", "tiny", 1000, 100))
    second = service.schedule(RequestFeatures("r1", "tiny", 1000, 100))
    assert first.prefill is not None and second.prefill is not None
    assert first.prefill.instance_id != second.prefill.instance_id  # the other's queue is empty
    assert first.decode.instance_id == second.decode.instance_id == "d1"  # shorter steps


def test_decode_load_counts_releases_since_its_report(
    fake_source: type, make_instance: MakeInstance, clock: Clock
) -> None:
    # d0's report counts the 3 requests the scheduler sent it; all 3 ended since, so d0 is
    # empty though its report says 3, and d1 (2 running, not this scheduler's) is the busier.
    kv = {"free_kv_blocks": 1000, "total_kv_blocks": 1000}
    source = fake_source(
        make_instance("p0", "prefill"),
        make_instance("d0", "decode", **kv),
        make_instance("d1", "decode", num_running=2, **kv),
    )
    service = Decider(
        CandidateView(source),
        prefill_policy="kv_aware",
        decode_policy="kv_aware",
        inflight=InflightTracker(clock=clock),
    )
    for i in range(3):
        decision = service.schedule(
            RequestFeatures(f"r{i}", "tiny", 64, 16, exclude_instance_ids=("d1",))
        )
        assert decision.decode.instance_id == "d0"
    clock.now += 1.0  # their prompts computed on p0: they run on d0 when it reports
    report = {"num_running": 3, "free_kv_blocks": 985, "total_kv_blocks": 1000}
    source.put(make_instance("d0", "decode", revision=5, **report))
    assert service.schedule(RequestFeatures("r3", "tiny", 64, 16)).decode.instance_id == "d1"
    service.release("r3", "success")
    for i in range(3):
        service.release(f"r{i}", "success")
    # Without the credit d0 would count 3 and lose to d1's 2.
    assert service.schedule(RequestFeatures("r4", "tiny", 64, 16)).decode.instance_id == "d0"


def test_streams_sharing_a_prefix_count_at_their_whole_context(
    fake_source: type, make_instance: MakeInstance, clock: Clock
) -> None:
    # d1 runs 5 requests over one 1,500-token prompt, d0 4 over prompts of their own. d1's
    # KV cache holds that prompt once, so by its usage d1 looked the emptier; but each of its
    # streams attends over the whole prompt, so its steps are the longer.
    kv = {"free_kv_blocks": 1000, "total_kv_blocks": 1000}
    source = fake_source(
        make_instance("p0", "prefill"),
        make_instance("d0", "decode", **kv),
        make_instance("d1", "decode", **kv),
    )
    service = Decider(
        CandidateView(source),
        prefill_policy="kv_aware",
        decode_policy="kv_aware",
        inflight=InflightTracker(clock=clock),
    )
    for i in range(9):
        other = "d1" if i < 4 else "d0"
        request = RequestFeatures(f"r{i}", "tiny", 1500, 100, exclude_instance_ids=(other,))
        assert service.schedule(request).decode.instance_id != other
    clock.now += 1.0  # their prompts computed: they run on their decodes when those report
    for name, running, used in (("d0", 4, 4 * 95), ("d1", 5, 94 + 5 * 2)):
        report = {"free_kv_blocks": 1000 - used, "kv_cache_usage": used / 1000}
        source.put(
            make_instance(
                name, "decode", revision=5, num_running=running, total_kv_blocks=1000, **report
            )
        )
    decision = service.schedule(RequestFeatures("r9", "tiny", 1500, 100))
    assert decision.decode.instance_id == "d0"


def test_decode_prefers_the_decode_holding_the_prefix(
    fleet: Callable[..., Decider],
) -> None:
    service = fleet()
    prompt = tokens(7, 30 * BS)
    hold(service.kv_index, "d1", prompt[: 24 * BS])  # type: ignore[arg-type]
    for i in range(3):
        decision = service.schedule(req(i, prompt))
        service.release(f"r{i}", "success")
        assert decision.decode.instance_id == "d1"  # a shorter pull
        assert decision.decode_cached_tokens == 24 * BS
        assert decision.prefill is not None  # local prefill is off


def test_decode_guard_still_applies_to_the_holder(
    fleet: Callable[..., Decider],
) -> None:
    service = fleet({"d1": {"free_kv_blocks": 1, "total_kv_blocks": 100}})
    prompt = tokens(8, 30 * BS)
    hold(service.kv_index, "d1", prompt)  # type: ignore[arg-type]
    decision = service.schedule(req(0, prompt))
    assert decision.decode.instance_id == "d0"  # no KV room on d1, whatever it holds


def test_conditional_disaggregation_skips_prefill(
    fleet: Callable[..., Decider],
) -> None:
    metrics = SchedulerMetrics()
    service = fleet(local_prefill_max_tokens=64, metrics=metrics)
    turn1 = tokens(9, 20 * BS)
    hold(service.kv_index, "d0", turn1)  # type: ignore[arg-type]
    turn2 = turn1 + tokens(10, 40)  # the next chat turn: 40 new tokens
    decision = service.schedule(req(0, turn2))
    assert decision.prefill is None
    assert decision.decode.instance_id == "d0"
    assert decision.decode_cached_tokens == 20 * BS
    assert decision.reason.startswith(f"no prefill: decode holds {20 * BS}/{20 * BS + 40} tokens")
    assert "computes the rest" in decision.reason
    # Counted on decode only; nothing queued on either prefill.
    assert service.inflight.inflight_by_instance() == {"d0": 1}
    assert service.inflight.busy_until("p0") == service.inflight.busy_until("p1") == 0
    assert metrics.registry.get_sample_value("pdplane_scheduler_prefills_skipped_total") == 1
    assert (
        metrics.registry.get_sample_value(
            "pdplane_scheduler_predicted_prefix_hit_tokens_total", {"instance_id": "d0"}
        )
        == 20 * BS
    )
    service.release("r0", "success")
    assert service.inflight.inflight_by_instance() == {}
    # More than 64 tokens beyond decode's prefix: disaggregated as usual.
    longer = service.schedule(req(1, turn1 + tokens(11, 100)))
    assert longer.prefill is not None and longer.decode_cached_tokens == 20 * BS


#: Both decodes run 200 streams over long contexts: a long step.
BUSY_DECODES = {
    d: {
        "num_running": 200,
        "kv_cache_usage": 0.9,
        "free_kv_blocks": 5_000,
        "total_kv_blocks": 50_000,
    }
    for d in ("d0", "d1")
}


def test_with_the_first_token_from_prefill_an_idle_prefill_answers_sooner_than_decode(
    fleet: Callable[..., Decider],
) -> None:
    # A chat turn 40 tokens past a prefix the busy d0 holds (200 streams over long contexts:
    # a long step). Computing them there answers after half a step's wait and a step, sooner
    # than prefill + pull + decode's step; but when the client's first token is prefill's own
    # (docs/first-token.md), the idle prefill's short step answers far sooner, so the request
    # is disaggregated.
    turn1 = tokens(9, 20 * BS)
    turn2 = turn1 + tokens(10, 40)
    for from_prefill, local in ((False, True), (True, False)):
        service = fleet(
            BUSY_DECODES, local_prefill_max_tokens=64, kv_weights=KvAwareWeights(local_slack=1.0)
        )
        hold(service.kv_index, "d0", turn1)  # type: ignore[arg-type]
        request = dataclasses.replace(req(0, turn2), first_token_from_prefill=from_prefill)
        decision = service.schedule(request)
        assert (decision.prefill is None) is local, (from_prefill, decision.reason)
        assert decision.decode.instance_id == "d0"  # the holder either way: a shorter pull


def test_a_local_prefill_that_would_slow_a_busy_decode_is_disaggregated(
    fleet: Callable[..., Decider],
) -> None:
    # Both decodes run 200 streams over long contexts; d0 holds the prefix. 120 more tokens
    # in its step would lengthen it by ~9 % (past the default profile's memory-bound floor),
    # so the rest is prefilled and pulled; with a large slack it is computed there.
    turn1 = tokens(12, 100 * BS)
    turn2 = turn1 + tokens(13, 120)
    for slack, local in ((0.02, False), (1.0, True)):
        service = fleet(
            BUSY_DECODES,
            local_prefill_max_tokens=2048,
            kv_weights=KvAwareWeights(local_slack=slack),
        )
        hold(service.kv_index, "d0", turn1)  # type: ignore[arg-type]
        hold(service.kv_index, "d1", turn1[: 4 * BS])  # type: ignore[arg-type]
        decision = service.schedule(req(0, turn2))
        assert (decision.prefill is None) is local, (slack, decision.reason)


def test_an_idle_decode_holding_every_whole_block_computes_the_tail_itself(
    fake_source: type, make_instance: MakeInstance, clock: Clock
) -> None:
    # vLLM CPU's 128-token blocks: a chat's second turn 95 tokens past a 1,920-token prefix that
    # the idle d0 holds. Computing the partial last block there stalls nobody; a prefill leg
    # would compute it and send 1,920 tokens of KV. It grows d0's idle step by more than the
    # 2 % slack, so only "idle and the tail alone" lets it. A longer rest is still disaggregated.
    bs = 128
    instances = [
        make_instance(name, role, block_size=bs)
        for name, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"))
    ]
    service = Decider(
        CandidateView(fake_source(*instances)),
        prefill_policy="kv_aware",
        decode_policy="kv_aware",
        local_prefill_max_tokens=2048,
        inflight=InflightTracker(clock=clock),
        kv_profile="tiny-cpu",  # vLLM CPU's: a token's compute is large beside a step's floor
    )
    index = service.kv_index = PrefixIndex()
    turn1 = tokens(14, 15 * bs)
    d0 = index.add_instance("d0")
    d0.stored(
        kv_events_pb2.BlockStored(
            block_hashes=[next(engine_hashes) for _ in range(15)],
            token_ids=turn1,
            block_size=bs,
        )
    )
    index.set_state(d0, KvState.LIVE)

    def features(n: int, prompt: list[int]) -> RequestFeatures:
        hashes = {bs: block_hashes(prompt, bs)}
        return RequestFeatures(f"r{n}", "tiny", len(prompt), prefix_hashes=hashes)

    decision = service.schedule(features(0, turn1 + tokens(15, 95)))
    assert decision.prefill is None, decision.reason
    assert decision.decode.instance_id == "d0"
    service.release("r0", "success")
    longer = service.schedule(features(1, turn1[: 14 * bs] + tokens(16, 2 * bs)))
    assert longer.prefill is not None, longer.reason


def test_a_short_prompt_decode_holds_nothing_of_is_still_disaggregated(
    fleet: Callable[..., Decider],
) -> None:
    service = fleet(local_prefill_max_tokens=256)
    hold(service.kv_index, "d0", tokens(12, 4 * BS))  # type: ignore[arg-type]
    decision = service.schedule(req(0, tokens(13, 40)))
    assert decision.prefill is not None


def test_a_decision_without_prefill_crosses_the_wire() -> None:
    decode = scheduler_pb2.InstanceRef(instance_id="d0", url="http://d0", kv_endpoint="d0:1")
    pb = decision_to_pb(Decision(None, decode, "no prefill", 0, 256))
    assert not pb.HasField("prefill") and pb.decode_cached_tokens == 256
    back = decision_from_pb(pb)
    assert back.prefill is None and back.decode.instance_id == "d0"
    assert (back.reason, back.prefill_cached_tokens, back.decode_cached_tokens) == (
        "no prefill",
        0,
        256,
    )
    both = decision_from_pb(decision_to_pb(Decision(decode, decode, "", 128, 0)))
    assert both.prefill is not None and both.prefill_cached_tokens == 128


def test_hashes_of_another_block_size_never_match(fleet: Callable[..., Decider]) -> None:
    service = fleet()
    prompt = tokens(14, 16 * BS)
    hold(service.kv_index, "p1", prompt)  # type: ignore[arg-type]
    other = RequestFeatures(
        "r0", "tiny", len(prompt), prefix_hashes={2 * BS: block_hashes(prompt, 2 * BS)}
    )
    assert service.schedule(other).prefill_cached_tokens == 0
    # The legacy field (block size unsaid) is matched at each instance's own block size.
    legacy = RequestFeatures(
        "r1", "tiny", len(prompt), prefix_block_hashes=block_hashes(prompt, BS)
    )
    assert service.schedule(legacy).prefill_cached_tokens == 16 * BS


def test_the_weights_are_checked() -> None:
    with pytest.raises(ValueError):
        KvAwareWeights(itl_weight=-1)
    with pytest.raises(ValueError):
        KvAwareWeights(local_slack=-0.1)
