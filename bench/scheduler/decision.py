"""Scheduler decision cost in process, per policy and fleet size.

    .venv/bin/python bench/scheduler/decision.py [--sizes 10,1000,10000] [--decisions 3000]
        [--prompt-tokens 8192] [--json]

`Decider.schedule` over a static view of N instances (N/2 prefill, N/2 decode, random
loads), same policy on both sides, metrics on, a steady 64 requests in flight (each decision
releases the one scheduled 64 earlier); wall-clock and thread-CPU percentiles (nearest rank;
CPU time excludes preemption on a busy machine, so compare the CPU columns). Rows marked "+report"
apply one new load report (a registry revision) before every decision, so the view's refresh
is included: the worst case of a fleet whose heartbeats all change load.

`kv_aware` rows decide as `pdplane scheduler` does by default, prefix warming on
(`pdplane.scheduler.warming`, its default settings; "-warm" rows with it off), with a prefix
index in which every instance is LIVE and holds a shared 512-token system prefix plus blocks
of its own, and 3 instances hold the whole prompt (the lookup's worst case: its walk runs to
the end); each request carries the exact hashes of a `--prompt-tokens` prompt (block size 16)
sharing that prefix, as a uint64 array (what a scheduler process has once
`wire.features_from_pb` read the request). Every request reads that one hot prefix: warming's
worst case too (the "warms" column counts the hints given).

All rows are measured in one loop, taking turns of 50 decisions (in the opposite order every
other turn), so that every row sees the same machine (a shared one: compare ratios, not
absolute times).

The ratios printed at the end are the goals of docs/scheduler.md, measured in this run against
a trivial baseline: round_robin at the smallest fleet size. The gRPC side is
`bench/scheduler/rpc.py`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import numpy as np

from pdplane.core.prefix_hash import block_hashes
from pdplane.scheduler.decision import Decider
from pdplane.scheduler.kv_index import KvState, PrefixIndex
from pdplane.scheduler.metrics import SchedulerMetrics
from pdplane.scheduler.policies import POLICIES
from pdplane.scheduler.port import Outcome, RequestFeatures
from pdplane.scheduler.view import CandidateView, StaticSource
from pdplane.scheduler.warming import WarmSettings
from pdplane.v1 import instance_pb2
from tests.support.stats import percentile

_WINDOW = 64  # requests kept in flight during the runs
_WARM = 200  # first decisions not timed (caches, tables)
# Decisions of one row in a turn: rows alternate so that all see the same machine, in runs long
# enough that each finds its own data in the CPU caches (one decision a turn measured the
# other rows' cache misses).
_TURN = 50
_BLOCK = 16
_SHARED = 512  # tokens of the system prefix every instance holds
_LAYOUT = instance_pb2.KvLayout(
    num_layers=2, num_kv_heads=2, head_size=32, block_size=_BLOCK, dtype="float32"
)


def spec(
    index: int, role: instance_pb2.Role.ValueType, model: str = "tiny"
) -> instance_pb2.InstanceSpec:
    """The spec of bench instance `index` of `role` serving `model` (block size 16, TCP)."""
    kind = "p" if role == instance_pb2.ROLE_PREFILL else "d"
    return instance_pb2.InstanceSpec(
        instance_id=f"{model}-{kind}{index:05d}",
        role=role,
        model=model,
        url=f"http://127.0.0.1:{20000 + index % 20000}",
        kv_endpoint=f"127.0.0.1:{40000 + index % 20000}",
        transport=instance_pb2.TRANSPORT_TCP,
        tp_size=1,
        kv_layout=_LAYOUT,
        max_model_len=32768,
        version="bench",
    )


def _instance(
    index: int, role: instance_pb2.Role.ValueType, rng: random.Random, revision: int
) -> instance_pb2.Instance:
    load = instance_pb2.LoadReport(
        num_running=rng.randrange(8),
        num_waiting=rng.randrange(4),
        kv_cache_usage=rng.random(),
        free_kv_blocks=10_000,
        total_kv_blocks=20_000,
    )
    return instance_pb2.Instance(
        spec=spec(index, role),
        state=instance_pb2.INSTANCE_STATE_SERVING,
        load=load,
        revision=revision,
    )


def _fleet(size: int, rng: random.Random) -> list[instance_pb2.Instance]:
    half = max(1, size // 2)
    return [_instance(i, instance_pb2.ROLE_PREFILL, rng, i + 1) for i in range(half)] + [
        _instance(i, instance_pb2.ROLE_DECODE, rng, half + i + 1) for i in range(half)
    ]


def _index(
    fleet: list[instance_pb2.Instance], prompt: list[int], rng: random.Random
) -> PrefixIndex:
    """Every instance LIVE with the shared prefix and 64 blocks of its own; the first prefill,
    the first decode and the second prefill hold the whole prompt."""
    index = PrefixIndex()
    shared = block_hashes(prompt[:_SHARED], _BLOCK)
    full = block_hashes(prompt, _BLOCK)
    half = len(fleet) // 2
    whole = {0, 1, half} if half > 1 else {0}
    for i, instance in enumerate(fleet):
        inst = index.add_instance(instance.spec.instance_id)
        own = list(full if i in whole else shared)
        own += [rng.getrandbits(64) for _ in range(64)]
        inst.stored_own("GPU", [rng.getrandbits(64) for _ in own], own)
        index.set_state(inst, KvState.LIVE)
    return index


def _percentiles(samples_ns: list[int]) -> dict[str, float]:
    """Nearest-rank p50 / p99 of `samples_ns` (ns), in us, and their count."""
    return {
        "p50_us": percentile(samples_ns, 50) / 1e3,
        "p99_us": percentile(samples_ns, 99) / 1e3,
        "n": len(samples_ns),
    }


class _Row:
    """One row of the table: a service over its own fleet and the requests it decides."""

    def __init__(
        self, size: int, policy: str, decisions: int, churn: bool, prompt_tokens: int, warm: bool
    ) -> None:
        rng = self.rng = random.Random(size)
        self.size, self.policy, self.churn, self.warm = size, policy, churn, warm
        self.fleet = _fleet(size, rng)
        self.source = StaticSource(*self.fleet)
        self.service = Decider(
            CandidateView(self.source),
            prefill_policy=policy,
            decode_policy=policy,
            metrics=SchedulerMetrics(),
            seed=0,
            warm=WarmSettings() if warm else WarmSettings(min_tokens=0),
        )
        hashes: dict[int, Any] = {}
        if policy == "kv_aware":
            prompt = [rng.randrange(50_000) for _ in range(prompt_tokens)]
            self.service.kv_index = _index(self.fleet, prompt, rng)
            # As a scheduler process receives them (`wire.features_from_pb`): a uint64 array.
            hashes = {_BLOCK: np.array(block_hashes(prompt, _BLOCK), np.uint64)}
        self.requests = [
            RequestFeatures(
                request_id=f"r{i}",
                model="tiny",
                prompt_tokens=prompt_tokens if hashes else rng.randrange(16, 2048),
                max_tokens=128,
                routing_key=f"user-{rng.randrange(1000)}",
                prefix_hashes=hashes,
            )
            for i in range(decisions + _WARM)
        ]
        self.revision = len(self.fleet)
        self.wall: list[int] = []
        self.cpu: list[int] = []  # CPU time of this thread: what the decision costs unpreempted
        self.warms = 0  # decisions that carried a prefix warm

    def decide(self, i: int) -> None:
        """Decision `i` (timed after the warm-up), then the release of the one 64 before."""
        if self.churn:
            self.revision += 1
            index = self.rng.randrange(len(self.fleet))
            role = self.fleet[index].spec.role
            half = len(self.fleet) // 2 or 1
            self.source.put(_instance(index % half, role, self.rng, self.revision))
        request = self.requests[i]
        started, cpu_started = time.perf_counter_ns(), time.thread_time_ns()
        decision = self.service.schedule(request)
        elapsed, cpu = time.perf_counter_ns() - started, time.thread_time_ns() - cpu_started
        self.warms += decision.warm is not None
        if i >= _WARM:
            self.wall.append(elapsed)
            self.cpu.append(cpu)
        if i >= _WINDOW:
            self.service.release(self.requests[i - _WINDOW].request_id, Outcome.SUCCESS)

    def result(self) -> dict[str, Any]:
        return {
            "instances": self.size,
            "policy": self.policy
            + (" +report" if self.churn else "")
            + (" -warm" if self.policy == "kv_aware" and not self.warm else ""),
            "warms": self.warms,
            **_percentiles(self.wall),
            **{f"cpu_{k}": v for k, v in _percentiles(self.cpu).items() if k != "n"},
        }


def bench_in_process(
    rows: list[tuple[int, str, bool, bool]], decisions: int, prompt_tokens: int = 8192
) -> list[dict[str, Any]]:
    """Times `decisions` calls of Decider.schedule per (size, policy, +report, warming) row,
    the rows taking turns (`_TURN` decisions each) so that all see the same machine."""
    setups = [
        _Row(size, policy, decisions, churn, prompt_tokens, warm)
        for size, policy, churn, warm in rows
    ]
    for turn, start in enumerate(range(0, decisions + _WARM, _TURN)):
        # The order flips every turn: a row that always ran first paid the cache misses of
        # the rows before it (2% of its decisions: its p99) and its neighbour did not.
        for setup in setups if turn % 2 == 0 else setups[::-1]:
            for i in range(start, min(start + _TURN, decisions + _WARM)):
                setup.decide(i)
    return [setup.result() for setup in setups]


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def fmt(value: Any) -> str:
        return f"{value:.1f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """CPU p99 of each row over round_robin's at the smallest size (the baseline)."""
    smallest = min(r["instances"] for r in rows)
    base = next(r for r in rows if r["instances"] == smallest and r["policy"] == "round_robin")
    return {f"{r['policy']} @{r['instances']}": r["cpu_p99_us"] / base["cpu_p99_us"] for r in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,1000,10000", help="fleet sizes (instances)")
    parser.add_argument("--decisions", type=int, default=3000, help="timed decisions per row")
    parser.add_argument("--prompt-tokens", type=int, default=8192, help="kv_aware's prompt")
    parser.add_argument("--policies", default=",".join(POLICIES), help="policies to time")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    policies = args.policies.split(",")
    # kv_aware without warming right after kv_aware: neighbours in a turn see the same caches.
    wanted = [
        row
        for size in sizes
        for policy in policies
        for row in [(size, policy, False, True)]
        + ([(size, policy, False, False)] if policy == "kv_aware" else [])
    ]
    wanted += [(size, "least_loaded", True, True) for size in sizes]
    rows = bench_in_process(wanted, args.decisions, args.prompt_tokens)
    if args.json:
        print(json.dumps({"in_process": rows, "ratios": ratios(rows)}, indent=2))
        return
    print("In-process decision latency (us)")
    columns = ["instances", "policy", "p50_us", "p99_us", "cpu_p50_us", "cpu_p99_us", "warms"]
    print(_table(rows, columns))
    print(f"\nCPU p99 / round_robin's at {min(sizes)} instances (same run)")
    for name, ratio in ratios(rows).items():
        print(f"  {name}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
