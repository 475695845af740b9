"""The engine model on a virtual clock: vLLM's step loop, chunked prefill, preemption, loads."""

from __future__ import annotations

import pytest

from pdplane.sim.engine import EngineCore, EngineLimits, EngineRequest, Phase
from pdplane.sim.offline import run_offline
from pdplane.sim.profiles import CostModel

#: 1 ms per step plus 0.01 ms per computed token: easy to reason about.
COST = CostModel(step_ms=1.0, token_ms=0.01)


def core(**limits: object) -> EngineCore:
    return EngineCore(EngineLimits(**limits), COST)  # type: ignore[arg-type]


def req(rid: str, prompt: int, out: int, *, base: int = 0, **kw: object) -> EngineRequest:
    return EngineRequest(rid, list(range(base, base + prompt)), [7] * out, **kw)  # type: ignore[arg-type]


def test_step_time_is_the_documented_formula() -> None:
    cost = CostModel(
        step_ms=1,
        weights_ms=5,
        token_ms=0.01,
        prefill_token_ms=0.002,
        seq_ms=0.1,
        kv_read_ms_per_ktok=0.5,
        prefill_attn_ms_per_mpair=2,
    )
    # max(5, 0.01 x 1000) = 10; + 0.002 x 900 + 0.1 x 3 + 0.5 x 4 + 2 x 0.5
    assert cost.step_time_ms(1000, 900, 3, 4000, 500_000) == pytest.approx(
        1 + 10 + 1.8 + 0.3 + 2 + 1
    )
    assert cost.step_time_ms(10, 0, 10, 0, 0) == pytest.approx(1 + 5 + 1)  # the weights floor
    assert cost.step_time_ms(0, 0, 0, 0, 0) == 0


def test_a_long_prompt_is_chunked_and_decodes_keep_running_between_chunks() -> None:
    engine = core(max_num_batched_tokens=2048, block_size=16, num_blocks=4096)
    short = req("short", 10, 20)
    long = req("long", 5000, 2, base=10_000)
    run = run_offline(engine, [(0.0, short), (0.0015, long)])
    t = run.timings
    # short: first step alone, then one token per step, also while long's chunks run
    assert len(t["short"].token_times) == 20
    # long needs ceil(5000 / (2048 - 1 decode token)) = 3 chunks before its first token
    chunk_steps = [s for s in t["short"].token_times if s <= t["long"].token_times[0]]
    assert len(chunk_steps) >= 3
    batch_sizes = engine.stats.computed_tokens
    assert batch_sizes == 10 + 19 + 5000 + 1  # every prompt token computed once, no recompute
    assert engine.stats.preemptions == 0


def test_requests_record_the_step_they_queued_at_and_the_step_of_their_first_token() -> None:
    # 512-token budget: a 2000-token prompt takes steps 1-4 (the 4th has 48 tokens to
    # spare), one queued with it takes those 48 and 1952 more in steps 5-8; one queued after
    # step 8 starts from the next step.
    engine = core(max_num_batched_tokens=512, block_size=16, num_blocks=4096)
    a, b = req("a", 2000, 1), req("b", 2000, 1, base=10_000)
    c = req("c", 600, 1, base=20_000)
    run_offline(engine, [(0.0, a), (0.0, b), (1.0, c)])  # 1 s: long after step 8 (~50 ms)
    assert (a.queued_step, a.first_token_step) == (0, 4)
    assert (b.queued_step, b.first_token_step) == (0, 8)
    assert (c.queued_step, c.first_token_step) == (8, 10)


def test_max_num_seqs_queues_the_rest_first_come_first_served() -> None:
    engine = core(max_num_seqs=2)
    reqs = [req(f"r{i}", 8, 5, base=100 * i) for i in range(3)]
    run = run_offline(engine, [(0.0, r) for r in reqs])
    first = {k: v.token_times[0] for k, v in run.timings.items()}
    assert first["r0"] == first["r1"] < first["r2"]
    assert first["r2"] >= run.timings["r0"].token_times[-1]  # admitted when r0 finished
    assert engine.stats.max_running == 2


def test_kv_exhaustion_preempts_the_newest_and_everything_still_finishes() -> None:
    # 8 blocks of 4 tokens = 32 slots; three requests of 4 + 8 tokens need 36.
    engine = core(num_blocks=8, block_size=4, prefix_caching=False)
    reqs = [req(f"r{i}", 4, 8, base=10 * i) for i in range(3)]
    run = run_offline(engine, [(0.0, r) for r in reqs])
    assert engine.stats.preemptions >= 1
    assert all(len(t.token_times) == 8 for t in run.timings.values())
    assert reqs[2].preemptions >= 1 and reqs[0].preemptions == 0  # the newest goes first
    assert engine.pool.num_free == engine.pool.num_blocks


def test_a_repeated_prompt_hits_the_prefix_cache_and_is_faster() -> None:
    engine = core(block_size=16, num_blocks=256)
    a, b = req("a", 1000, 2), req("b", 1000, 2)
    run = run_offline(engine, [(0.0, a), (1.0, b)])
    # all full blocks but the one holding the last prompt token: 62 x 16 = 992 tokens
    assert engine.stats.prefix_hits == 992
    assert engine.stats.prefix_queries == 2000
    assert run.timings["b"].ttft < run.timings["a"].ttft / 5


def test_a_follow_up_turn_hits_the_previous_answer_too() -> None:
    engine = core(block_size=4, num_blocks=256)
    first = EngineRequest("t1", list(range(8)), list(range(100, 112)))
    follow = EngineRequest("t2", [*range(8), *range(100, 112), 500, 501, 502], [9])
    run_offline(engine, [(0.0, first), (1.0, follow)])
    # t1 computed 8 + 11 tokens (the last sampled one never is): 4 full blocks of 4
    assert engine.stats.prefix_hits == 16


def test_remote_kv_is_loaded_then_the_last_prompt_token_is_recomputed() -> None:
    engine = core(block_size=16)
    remote = req("d", 100, 3, remote_tokens=100)
    run = run_offline(engine, [(0.0, remote)], load_s=0.5)
    t = run.timings["d"]
    assert t.ttft == pytest.approx(0.5 + 0.001 + 0.00001, rel=1e-6)  # load + a 1-token step
    assert engine.stats.computed_tokens == 1 + 2  # last prompt token, then 2 decodes


def test_a_failed_load_recomputes_the_prompt() -> None:
    engine = core(block_size=16)
    r = req("d", 100, 1, remote_tokens=100)
    engine.add(r, 0.0)
    step = engine.schedule(0.0)
    assert step.loads == [r] and not step.batch and r.phase == Phase.LOADING
    assert engine.num_waiting == 1 and engine.pool.num_free == engine.pool.num_blocks - 7
    engine.load_done(r, False, 0.1)
    step = engine.schedule(0.1)
    assert step.batch == [(r, 100)]
    assert engine.stats.recomputed_prompts == 1


def test_abort_frees_blocks_in_every_phase() -> None:
    engine = core(block_size=16, num_blocks=64)
    waiting, loading, running = req("w", 20, 5), req("l", 20, 5, remote_tokens=20), req("r", 20, 5)
    engine.add(running, 0.0)
    engine.complete(engine.schedule(0.0), 0.001)
    engine.add(loading, 0.001)
    engine.schedule(0.001)
    engine.add(waiting, 0.002)
    for r in (waiting, loading, running):
        engine.abort(r, 0.003)
        assert r.phase == Phase.DONE
    assert engine.pool.num_free == 64 and not engine.has_work and engine.num_waiting == 0


def test_a_held_request_keeps_its_blocks_until_released() -> None:
    engine = core(block_size=16, num_blocks=64)
    r = req("p", 40, 1, hold=True)
    run_offline(engine, [(0.0, r)])
    assert r.phase == Phase.DONE and len(r.blocks) == 3
    assert engine.pool.num_free == 61
    engine.release(r.blocks)
    assert engine.pool.num_free == 64
