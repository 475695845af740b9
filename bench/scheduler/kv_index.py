"""Prefix index benchmark: event ingest rate, lookup latency, memory per entry.

    python bench/scheduler/kv_index.py [--quick] [--batch-events N] [--ingest-only]

1. Ingest (one core, one instance; rates from this thread's CPU time, which preemption on a
   shared machine does not inflate): `InstanceBlocks.apply` of BlockStored events as they come
   off the stream (protobuf), block sizes 16 and 128, events of 1 and 32 blocks, followed by
   their BlockRemoved, with the token ids only (the index hashes them) and with the source's
   own hashes (`BlockStored.own_hashes`: the index only updates its tables). Side by side: the
   own-hash computation alone, the table updates alone (hashes precomputed), and what the
   source pays: `KvEventLog.stored` per block with and without computing our hashes. The
   "stream" columns are the real path of one stream: the same events into a `KvEventLog`
   (which computes our own hashes), encoded by `SubscriptionCursor` in messages of
   `--batch-events` events (plain `KvEvent`s, or the common single-block stores columnar:
   `KvEventBatch.stored_columns`), serialized; timed: the subscriber's parse of each message
   and `KvStreamReader.feed` (`InstanceBlocks.apply_events` / `apply_batch`: runs merged into
   one table update). "source: encode + serialize" is what the source pays per subscriber
   for the same messages (stores and removals).
2. Lookup: `PrefixIndex.match` of 1k / 8k / 32k-token prompts (block size 16) at 10 / 100 /
   1,000 LIVE instances; every instance holds a shared 512-token system prefix plus its own
   prompts, and 3 instances hold the whole queried prompt (the walk's worst case: it runs to
   the end). p50 / p99 (nearest rank) over repeated calls; the prompt's own hashing (gateway
   side, p50) beside it.
3. Memory: bytes per (instance, block) entry measured with tracemalloc on 1,000 instances x
   N blocks, distinct blocks (worst case) and 90% shared, extrapolated to 1,000 x 100k.
   `--full-memory`: instead, builds the full 1,000 x 100k index once per layout and reports the
   process's resident memory (RSS) before and after (needs ~6 GiB free).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time
import tracemalloc

import numpy as np

from pdplane.core.kv_events.log import KvEventLog, SubscriptionCursor
from pdplane.core.prefix_hash import HASH_VERSION, block_hashes
from pdplane.scheduler.kv_index import KvState, PrefixIndex
from pdplane.scheduler.kv_index.stream import KvStreamReader
from pdplane.v1 import kv_events_pb2
from tests.support.stats import percentile

_U64 = (1 << 64) - 1
Msg = kv_events_pb2.KvEventsMessage


def _events(n_blocks: int, per_event: int, bs: int, seed: int) -> list[kv_events_pb2.KvEvent]:
    rng = random.Random(seed)
    out = []
    parent = None
    eng = seed << 32
    for start in range(0, n_blocks, per_event):
        k = min(per_event, n_blocks - start)
        hashes = [eng + start + i for i in range(k)]
        msg = kv_events_pb2.BlockStored(
            block_hashes=hashes,
            token_ids=[rng.randrange(100_000) for _ in range(k * bs)],
            block_size=bs,
        )
        if parent is not None:
            msg.parent_block_hash = parent
        parent = hashes[-1]
        out.append(kv_events_pb2.KvEvent(stored=msg))
    return out


def _with_own(events: list[kv_events_pb2.KvEvent], bs: int) -> list[kv_events_pb2.KvEvent]:
    out = []
    parent = None
    for ev in events:
        own = block_hashes(ev.stored.token_ids, bs, parent=parent)
        parent = own[-1]
        msg = kv_events_pb2.KvEvent()
        msg.CopyFrom(ev)
        msg.stored.own_hashes.extend(own)
        msg.stored.hash_version = HASH_VERSION
        out.append(msg)
    return out


def _apply_rate(events: list[kv_events_pb2.KvEvent], n: int) -> float:
    index = PrefixIndex()
    inst = index.add_instance("i0")
    t0 = time.thread_time()
    for ev in events:
        inst.apply(ev)
    rate = n / (time.thread_time() - t0)
    assert index.entries == n and inst.orphans == 0
    return rate


def _wire(cursor: SubscriptionCursor) -> tuple[list[bytes], float]:
    """Every message `cursor` has ready, serialized; and the seconds that took (source side,
    per subscriber: `SubscriptionCursor.next_message` and `SerializeToString`)."""
    out = []
    t0 = time.thread_time()
    while (msg := cursor.next_message()) is not None:
        out.append(msg.SerializeToString())
    return out, time.thread_time() - t0


def _stream_rates(
    events: list[kv_events_pb2.KvEvent], n: int, batch: int, columnar: bool
) -> tuple[float, float, float]:
    """The real path of one stream: `KvEventLog.stored` of `events` (it computes our own
    hashes), then `removed` of their blocks; `SubscriptionCursor` encodes them in messages of
    `batch` events (`columnar`: common single-block stores as `stored_columns`), serialized;
    the subscriber parses each message and `KvStreamReader.feed`s it into the index.
    Returns blocks/s of (parse + feed of the stores, of the removals, source encoding)."""
    log = KvEventLog(replay_blocks=2 * n + 1, replay_events=2 * len(events) + 1)
    for ev in events:
        st = ev.stored
        parent = st.parent_block_hash if st.HasField("parent_block_hash") else None
        log.stored(st.block_hashes, parent, st.token_ids, st.block_size)
    cursor = SubscriptionCursor(log, log.epoch, 1, batch_events=batch, columnar=columnar)
    store_wire, t_enc = _wire(cursor)
    for ev in events:
        log.removed(ev.stored.block_hashes)
    remove_wire, t_enc2 = _wire(cursor)
    index = PrefixIndex()
    inst = index.add_instance("i0")
    reader = KvStreamReader(inst)
    snapshot = kv_events_pb2.KvEventsMessage(epoch=log.epoch, sequence=0)
    snapshot.snapshot.last = True
    reader.feed(snapshot)  # empty snapshot: the reader is synced
    parse = Msg.FromString
    rates = []
    for wire, entries in ((store_wire, n), (remove_wire, 0)):
        t0 = time.thread_time()
        for raw in wire:
            reader.feed(parse(raw))
        rates.append(n / (time.thread_time() - t0))
        assert index.entries == entries and inst.orphans == 0
    return rates[0], rates[1], 2 * n / (t_enc + t_enc2)


def _source_rate(events: list[kv_events_pb2.KvEvent], n: int, own: bool) -> float:
    log = KvEventLog(own_hashes=own, replay_blocks=n + 1, replay_events=len(events) + 1)
    t0 = time.thread_time()
    for ev in events:
        st = ev.stored
        parent = st.parent_block_hash if st.HasField("parent_block_hash") else None
        log.stored(st.block_hashes, parent, st.token_ids, st.block_size)
    return n / (time.thread_time() - t0)


def ingest(quick: bool, batch: int) -> None:
    print("## ingest (block events/s, one core, one instance)")
    print(
        "| block size | blocks/event | apply stored | apply stored, own hashes sent "
        "| apply removed "
        f"| stream stored, plain events ({batch} events/batch) "
        f"| stream stored, columnar ({batch} events/batch) "
        f"| stream removed ({batch} events/batch) "
        "| source: encode + serialize, plain | source: encode + serialize, columnar "
        "| hash only | tables only | source: log.stored | source: log.stored + own hashes |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    n = 20_000 if quick else 100_000
    for bs in (16, 128):
        for per_event in (1, 32):
            events = _events(n, per_event, bs, seed=bs + per_event)
            index = PrefixIndex()
            inst = index.add_instance("i0")
            t0 = time.thread_time()
            for ev in events:
                inst.apply(ev)
            t_store = time.thread_time() - t0
            removes = [
                kv_events_pb2.KvEvent(
                    removed=kv_events_pb2.BlockRemoved(block_hashes=ev.stored.block_hashes)
                )
                for ev in events
            ]
            t0 = time.thread_time()
            for ev in removes:
                inst.apply(ev)
            t_remove = time.thread_time() - t0
            assert index.entries == 0
            # baseline 1: own hashes alone (chained like the events)
            t0 = time.thread_time()
            parent = None
            own_all = []
            for ev in events:
                own = block_hashes(ev.stored.token_ids, bs, parent=parent)
                parent = own[-1]
                own_all.append(own)
            t_hash = time.thread_time() - t0
            # baseline 2: the table updates alone, hashes given
            table: dict[int, int] = {}
            mapping: dict[int, int] = {}
            t0 = time.thread_time()
            for ev, own in zip(events, own_all, strict=True):
                for e, h in zip(ev.stored.block_hashes, own, strict=True):
                    mapping[e] = h
                    table[h] = table.get(h, 0) | 1
            t_tables = time.thread_time() - t0
            with_own = _with_own(events, bs)
            t_own = n / _apply_rate(with_own, n)
            plain_store, stream_remove, enc_plain = _stream_rates(events, n, batch, False)
            col_store, _, enc_col = _stream_rates(events, n, batch, True)
            t_src = n / _source_rate(events, n, own=False)
            t_src_own = n / _source_rate(events, n, own=True)
            times = (
                t_store,
                t_own,
                t_remove,
                n / plain_store,
                n / col_store,
                n / stream_remove,
                n / enc_plain,
                n / enc_col,
                t_hash,
                t_tables,
                t_src,
                t_src_own,
            )
            rate = [n / t for t in times]
            print(f"| {bs} | {per_event} | " + " | ".join(f"{r / 1e3:,.0f}k" for r in rate) + " |")


def _populate(index: PrefixIndex, n_inst: int, prompt: list[int], bs: int, seed: int) -> None:
    rng = random.Random(seed)
    shared = block_hashes(prompt[:512], bs)
    full = block_hashes(prompt, bs)
    for i in range(n_inst):
        inst = index.add_instance(f"i{i}")
        index.set_state(inst, KvState.LIVE)
        own = list(shared) if i >= 3 else list(full)
        own += [rng.getrandbits(64) for _ in range(64)]  # its other cached blocks
        inst._add("GPU", [rng.getrandbits(64) for _ in own], own)


def lookup(quick: bool) -> None:
    print("\n## lookup (PrefixIndex.match, block size 16; us)")
    print("| instances | prompt tokens | blocks | match p50 | match p99 | prompt hashing p50 |")
    print("|---|---|---|---|---|---|")
    bs = 16
    reps = 200 if quick else 1000
    rng = random.Random(1)
    for n_inst in (10, 100, 1000):
        for tokens in (1024, 8192, 32768):
            prompt = [rng.randrange(100_000) for _ in range(tokens)]
            index = PrefixIndex()
            _populate(index, n_inst, prompt, bs, seed=n_inst + tokens)
            hashes = block_hashes(prompt, bs)
            got = index.match(hashes)
            assert got["i0"] == len(hashes) and (n_inst <= 3 or got[f"i{n_inst - 1}"] == 32)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                index.match(hashes)
                times.append(time.perf_counter() - t0)
            hash_times = []
            for _ in range(max(reps // 10, 20)):
                t0 = time.perf_counter()
                block_hashes(prompt, bs)
                hash_times.append(time.perf_counter() - t0)
            p50, p99 = percentile(times, 50), percentile(times, 99)
            print(
                f"| {n_inst} | {tokens} | {len(hashes)} | {p50 * 1e6:.0f} | {p99 * 1e6:.0f} "
                f"| {percentile(hash_times, 50) * 1e6:.0f} |"
            )


def memory(quick: bool) -> None:
    print("\n## memory (bytes per (instance, block) entry; tracemalloc)")
    print("| layout | instances x blocks | entries | MiB | bytes/entry | 1,000 x 100k projected |")
    print("|---|---|---|---|---|---|")
    per = 1_000 if quick else 4_000
    n_inst = 1000
    for label, shared_frac in (("distinct (worst case)", 0.0), ("90% shared", 0.9)):
        rng = random.Random(2)
        common = [rng.getrandbits(64) for _ in range(int(per * shared_frac))]
        gc.collect()
        tracemalloc.start()
        index = PrefixIndex()
        for i in range(n_inst):
            inst = index.add_instance(f"i{i}")
            own = common + [rng.getrandbits(64) for _ in range(per - len(common))]
            inst._add("GPU", [rng.getrandbits(64) for _ in range(per)], own)
        used, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        per_entry = used / index.entries
        projected = per_entry * 1000 * 100_000 / 2**30
        print(
            f"| {label} | {n_inst} x {per:,} | {index.entries:,} | {used / 2**20:,.0f} "
            f"| {per_entry:.0f} | {projected:.1f} GiB |"
        )
        del index
        gc.collect()


def _rss() -> int:
    """Resident bytes of this process (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_full() -> None:
    print("\n## memory at full size (RSS before / after building the index once)")
    print(
        "| layout | instances x blocks | entries | RSS before | RSS after | bytes/entry | build s |"
    )
    print("|---|---|---|---|---|---|---|")
    n_inst, per = 1000, 100_000
    for label, shared_frac in (("distinct (worst case)", 0.0), ("90% shared", 0.9)):
        rng = np.random.default_rng(2)
        common = rng.integers(2, 2**63, int(per * shared_frac), np.uint64, endpoint=False)
        gc.collect()
        before = _rss()
        t0 = time.perf_counter()
        index = PrefixIndex()
        for i in range(n_inst):
            inst = index.add_instance(f"i{i}")
            own = rng.integers(2, 2**63, per, np.uint64)
            own[: len(common)] = common
            inst._add("GPU", rng.integers(2, 2**63, per, np.uint64), own)  # type: ignore[arg-type]
        build = time.perf_counter() - t0
        gc.collect()
        after = _rss()
        assert index.entries == n_inst * per
        print(
            f"| {label} | {n_inst:,} x {per:,} | {index.entries:,} | {before / 2**30:.2f} GiB "
            f"| {after / 2**30:.2f} GiB | {(after - before) / index.entries:.0f} | {build:.0f} |"
        )
        del index, inst
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer events and repetitions")
    parser.add_argument(
        "--full-memory", action="store_true", help="only the full-size memory build (RSS)"
    )
    parser.add_argument(
        "--batch-events",
        type=int,
        default=100,
        help="events per KvEventBatch message in the stream columns",
    )
    parser.add_argument("--ingest-only", action="store_true", help="only the ingest table")
    args = parser.parse_args()
    if args.full_memory:
        memory_full()
        return
    ingest(args.quick, args.batch_events)
    if args.ingest_only:
        return
    lookup(args.quick)
    memory(args.quick)


if __name__ == "__main__":
    main()
