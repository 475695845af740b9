"""The decision tables stay equal to tables built fresh, whatever happens between decisions;
the prefix index's bulk lookup agrees with `match`."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from pdplane.core.prefix_hash import block_hashes
from pdplane.scheduler.decision import Decider
from pdplane.scheduler.errors import NoInstance
from pdplane.scheduler.inflight import InflightTracker
from pdplane.scheduler.kv_index import KvState, PrefixIndex
from pdplane.scheduler.port import RequestFeatures
from pdplane.scheduler.table import ModelTables
from pdplane.scheduler.view import CandidateView
from pdplane.v1 import instance_pb2, kv_events_pb2

MakeInstance = Callable[..., instance_pb2.Instance]


def _fresh(view: CandidateView, tracker: InflightTracker) -> ModelTables:
    tables = ModelTables(view.candidates("tiny"))
    for table in tables.sides():
        table.write_all(tracker)
    return tables


def _columns(tables: ModelTables) -> list[npt.NDArray[np.float64]]:
    # KV_SLOT (the last column) is read from the index per decision: not compared here.
    return [table.cols[:, :-1].copy() for table in tables.sides()]


def test_rows_follow_reports_assignments_releases_and_ageing(
    fake_source: type, make_instance: MakeInstance
) -> None:
    """200 random steps (load reports, Schedules, Releases, the reservation window ending, an
    instance leaving and coming back); after each, the tables a decision reads equal tables
    built from scratch from the same view and in-flight counts."""
    rng = random.Random(3)
    now = [100.0]
    tracker = InflightTracker(reservation_s=5.0, clock=lambda: now[0])
    names = [(f"p{i}", "prefill") for i in range(3)] + [(f"d{i}", "decode") for i in range(4)]
    names.append(("b0", "both"))
    revision = [1]

    def report(name: str, role: str) -> instance_pb2.Instance:
        revision[0] += 1
        return make_instance(
            name,
            role,
            revision=revision[0],
            num_running=rng.randrange(4),
            kv_cache_usage=rng.random(),
            free_kv_blocks=rng.randrange(20, 200),
            total_kv_blocks=200,
        )

    source = fake_source(*(report(n, r) for n, r in names))
    service = Decider(CandidateView(source), inflight=tracker, seed=1)
    in_flight: list[str] = []
    for step in range(200):
        action = rng.random()
        if action < 0.4:
            request_id = f"r{step}"
            try:
                service.schedule(RequestFeatures(request_id, "tiny", rng.randrange(1, 500), 16))
                in_flight.append(request_id)
            except NoInstance:
                pass
        elif action < 0.65 and in_flight:
            service.release(in_flight.pop(rng.randrange(len(in_flight))), "success")
        elif action < 0.9:
            source.put(report(*rng.choice(names)))
        elif action < 0.95:
            now[0] += 3.0
            tracker.age()
        else:
            name, role = rng.choice(names)
            if name in source.snapshot():
                source.remove(name)
            else:
                source.put(report(name, role))
        tables = service.view.tables("tiny", tracker)
        assert tables is not None
        expected = _fresh(service.view, tracker)
        for got, want in zip(_columns(tables), _columns(expected), strict=True):
            np.testing.assert_array_equal(got, want, err_msg=f"step {step}")


def test_match_slots_is_match_per_slot_in_bulk() -> None:
    """Every instance holds a shared prefix, a few the whole prompt, one is stale: the bulk
    lookup writes each LIVE holder's blocks x scale into its slot, keeps the larger of two
    lookups into one array, and leaves every other slot alone."""
    rng = random.Random(5)
    prompt = [rng.randrange(50_000) for _ in range(20 * 16)]
    index = PrefixIndex()
    for i in range(40):
        inst = index.add_instance(f"i{i}")
        held = prompt if i in (3, 17) else prompt[: (2 + i % 3) * 16]
        n = len(held) // 16
        inst.stored(
            kv_events_pb2.BlockStored(
                block_hashes=range(i << 20, (i << 20) + n), token_ids=held, block_size=16
            )
        )
        index.set_state(inst, KvState.STALE if i == 5 else KvState.LIVE)
    hashes = block_hashes(prompt, 16)
    out = np.full(len(index.live_slots), -1.0)
    assert index.match_slots(hashes, out, 16)
    found = index.match(hashes)
    for i in range(40):
        inst = index.instance(f"i{i}")
        assert inst is not None
        expected = found[f"i{i}"] * 16 if f"i{i}" in found else -1.0
        assert out[inst.slot] == expected, i
    assert "i5" not in found and out[index.instance("i5").slot] == -1.0  # type: ignore[union-attr]
    # A second lookup (another block size's hashes) keeps the larger value per slot.
    assert index.match_slots(hashes[:2], out, 100)
    assert out[index.instance("i0").slot] == 2 * 100  # type: ignore[union-attr]
    assert out[index.instance("i3").slot] == 20 * 16  # type: ignore[union-attr]
