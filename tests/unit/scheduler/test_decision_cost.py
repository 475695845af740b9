"""Guard: a decision at 1,000 instances costs about what one at 10 does (orderings, not times).

The decision scores the candidates' state as arrays (`pdplane.scheduler.table`) and reads only
the prefix index's holders, so its cost barely grows with the fleet; a scan of the fleet in
Python per decision fails this test.

The bound: the median thread-CPU time of a decision at 1,000 instances (500 prefill + 500
decode) is at most `K` = 4 times that of a baseline measured in the same run, the rows taking
turns so that all see the same machine:

* least_loaded at 1,000 vs round_robin at 10 (the trivial decision): ~1.5x; a Python scan of
  the fleet per decision measured 16-25x;
* kv_aware at 1,000 vs kv_aware at 10, both with a LIVE prefix index in which every instance
  holds a shared system prefix and 3 hold the whole 2,048-token prompt: ~1.5-1.7x; with a
  scan, 37-45x.

Medians of thread CPU time are what preemption on a busy CI host does not move; K leaves room
for the noise they still have.
"""

from __future__ import annotations

import random
import statistics
import time

from pdplane.core.prefix_hash import block_hashes
from pdplane.scheduler.decision import Decider
from pdplane.scheduler.kv_index import KvState, PrefixIndex
from pdplane.scheduler.port import RequestFeatures
from pdplane.scheduler.view import CandidateView, StaticSource
from pdplane.v1 import kv_events_pb2
from tests.unit.scheduler.conftest import instance

K = 4.0
BLOCK = 16  # the conftest instances' block size
PROMPT = 2048  # tokens of the kv_aware requests' prompt
SHARED = 512  # tokens of the system prefix every instance holds
TURNS, PER_TURN = 12, 25  # 300 timed decisions per row, after a warm-up turn
WINDOW = 64  # requests kept in flight (each decision releases the one 64 before)


def _hold(index: PrefixIndex, instance_id: str, tokens: list[int], engine: int) -> None:
    inst = index.add_instance(instance_id)
    n = len(tokens) // BLOCK
    inst.stored(
        kv_events_pb2.BlockStored(
            block_hashes=range(engine, engine + n), token_ids=tokens[: n * BLOCK], block_size=BLOCK
        )
    )
    index.set_state(inst, KvState.LIVE)


class _Row:
    """A service over `size` instances deciding `policy` on both sides."""

    def __init__(self, size: int, policy: str) -> None:
        rng = random.Random(size)
        half = size // 2
        fleet = [
            instance(
                f"{role[0]}{i:04d}",
                role,
                max_model_len=8192,
                revision=n + 1,
                num_running=rng.randrange(8),
                num_waiting=rng.randrange(4),
                kv_cache_usage=rng.random(),
                free_kv_blocks=10_000,
                total_kv_blocks=20_000,
            )
            for n, (role, i) in enumerate(
                [("prefill", i) for i in range(half)] + [("decode", i) for i in range(half)]
            )
        ]
        self.service = Decider(
            CandidateView(StaticSource(*fleet)), prefill_policy=policy, decode_policy=policy
        )
        hashes: dict[int, list[int]] = {}
        prompt_tokens = 512
        if policy == "kv_aware":
            prompt = [random.Random(7).randrange(50_000) for _ in range(PROMPT)]
            index = self.service.kv_index = PrefixIndex()
            for n, member in enumerate(fleet):
                whole = n in (0, 1, half)
                held = prompt if whole else prompt[:SHARED]
                _hold(index, member.spec.instance_id, held, engine=n << 20)
            hashes = {BLOCK: block_hashes(prompt, BLOCK)}
            prompt_tokens = PROMPT
        self.requests = [
            RequestFeatures(f"r{i}", "tiny", prompt_tokens, 128, prefix_hashes=hashes)
            for i in range((TURNS + 1) * PER_TURN)
        ]
        self.next = 0
        self.cpu_ns: list[int] = []

    def turn(self, timed: bool) -> None:
        for _ in range(PER_TURN):
            i = self.next
            self.next += 1
            started = time.thread_time_ns()
            self.service.schedule(self.requests[i])
            if timed:
                self.cpu_ns.append(time.thread_time_ns() - started)
            if i >= WINDOW:
                self.service.release(self.requests[i - WINDOW].request_id, "success")

    @property
    def median_us(self) -> float:
        return statistics.median(self.cpu_ns) / 1e3


def _measure(*rows: _Row) -> None:
    for row in rows:
        row.turn(timed=False)  # warm-up: caches, compiled kernels, tables
    for _ in range(TURNS):
        for row in rows:
            row.turn(timed=True)


def test_a_decision_at_1000_instances_costs_at_most_k_times_a_trivial_one() -> None:
    trivial = _Row(10, "round_robin")
    least_loaded = _Row(1000, "least_loaded")
    kv_small, kv_large = _Row(10, "kv_aware"), _Row(1000, "kv_aware")
    _measure(trivial, least_loaded, kv_small, kv_large)
    ratios = {
        "least_loaded@1000 / round_robin@10": least_loaded.median_us / trivial.median_us,
        "kv_aware@1000 / kv_aware@10": kv_large.median_us / kv_small.median_us,
    }
    report = ", ".join(f"{name} = {ratio:.2f}" for name, ratio in ratios.items())
    medians = (
        f"medians (us CPU): round_robin@10 {trivial.median_us:.1f}, least_loaded@1000 "
        f"{least_loaded.median_us:.1f}, kv_aware@10 {kv_small.median_us:.1f}, kv_aware@1000 "
        f"{kv_large.median_us:.1f}"
    )
    assert all(ratio <= K for ratio in ratios.values()), (
        f"a decision grows with the fleet: {report} (bound {K}); {medians}"
    )
