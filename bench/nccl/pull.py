"""NCCL pull benchmark: pdplane's pull of paged KV blocks vs raw NCCL send/recv, same run.

Two KV node processes (tests/support/nccl_node.py) on the GPU(s) hold a Llama-3-8B-shaped KV cache
(32 layers, 8 KV heads, head 128, bf16, block 16 tokens: 128 KiB per token) in FlashAttention
layout. For each prompt length, decode pulls a random, non-contiguous set of prefill blocks into
random decode blocks (gRPC control + NCCL data), and the same number of bytes is sent raw
between the same two ranks as one contiguous buffer. Also measured: the control-plane overhead
per transfer (a 1-block pull minus raw NCCL of the same bytes) and where it goes (decode's and
prefill's timestamps of each 1-block pull: both processes read one monotonic clock), the
pre-connect (the pair set up before any request) and the first pull through the pre-connected
pair against the later ones, two ways: against the 40 later pulls run back to back
(`first_over_later`), and against later pulls through the same, already used pair that each
follow the same pause as the first one (`--idle-gap-ms` after the previous command's answer,
then the same hold command: `first_over_idle_later`). The first ratio mixes first use with
idleness; the second leaves only first use. Bytes are verified by per-block checksums (first
repeat of each variant and size).

    python bench/nccl/pull.py --out results.json            # one GPU: NCCL socket transport
    python bench/nccl/pull.py --decode-device 1 ...         # two GPUs: NVLink / P2P

Prints a table; `--out` writes every number as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tests.support.nccl_cluster import NodeProcess

TOKEN_BYTES = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x heads x head size x bf16
BLOCK = 16


def _ok(answer: dict[str, Any]) -> dict[str, Any]:
    if answer.get("ok") is not True:
        raise RuntimeError(f"node answered {answer}")
    return answer


def _raw(decode: NodeProcess, prefill: NodeProcess, nbytes: int, iters: int) -> float:
    # Both ranks run their half at once; the node times from a joint 4-byte exchange.
    decode.send(
        "raw", peer=prefill.instance_id, is_send=False, nbytes=nbytes, iters=iters, timeout_s=120
    )
    prefill.send(
        "raw", peer=decode.instance_id, is_send=True, nbytes=nbytes, iters=iters, timeout_s=120
    )
    got = _ok(decode.answer(timeout=600))
    _ok(prefill.answer(timeout=600))
    return float(got["median_s"])


def _pull(
    decode: NodeProcess,
    prefill: NodeProcess,
    tid: str,
    src: list[int],
    dst: list[int],
    **extra: Any,
) -> dict[str, Any]:
    _ok(prefill.call("hold", transfer_id=tid, block_ids=src))
    return _ok(
        decode.call(
            "pull",
            endpoint=prefill.endpoint,
            peer_id=prefill.instance_id,
            transfer_id=tid,
            block_indices=list(range(len(src))),
            local_ids=dst,
            timeout_s=300,
            **extra,
        )
    )


def _breakdown(pulls: list[dict[str, Any]], prefill: NodeProcess) -> dict[str, float]:
    """Median phases of the pulls, from decode's timing and prefill's serve timings (both
    `time.monotonic()` instants of one host): request written, read by prefill, pinned,
    first send enqueued (then the verdict queued), sends enqueued, receives posted (decode),
    bytes in (decode)."""
    served = {t["transfer_id"]: t for t in _ok(prefill.call("serve_timings"))["timings"]}
    phases: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        phases.setdefault(name, []).append(seconds * 1e3)

    for p in pulls:
        s = served.get(p["transfer_id"])
        if s is None:
            continue
        start = p["started"]
        add("decode: request queued", p["sent_s"])
        add("request on the wire (stream)", s["received"] - (start + p["sent_s"]))
        add("prefill: pin + checks", s["pinned"] - s["received"])
        if s.get("first"):
            add("prefill: first gather + send enqueued", s["first"] - s["pinned"])
            add("prefill: verdict queued + other sends", s["enqueued"] - s["first"])
        add("prefill: gather + enqueue sends", s["enqueued"] - s["pinned"])
        add("decode: all receives posted", p["post_s"])
        add("decode: verdict in", p["verdict_s"])
        add("NCCL + completion seen (decode)", start + p["total_s"] - s["enqueued"])
        add("total", p["total_s"])
    return {k: round(statistics.median(v), 3) for k, v in phases.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1024,8192,32768")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-device", type=int, default=0)
    p.add_argument("--decode-device", type=int, default=0)
    p.add_argument("--chunk-mib", default="64,256", help="gather staging sizes to compare")
    p.add_argument(
        "--idle-gap-ms",
        type=float,
        default=100.0,
        help="pause before the first pull (after pre-connect) and before each idle later pull",
    )
    p.add_argument(
        "--idle-pulls", type=int, default=10, help="later 1-block pulls after the same pause"
    )
    p.add_argument("--out", type=Path)
    p.add_argument("--log-dir", type=Path)
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    chunk_sizes = [int(c) << 20 for c in args.chunk_mib.split(",")]
    max_blocks = max(tokens) // BLOCK
    num_blocks = max_blocks + max_blocks // 4 + 8
    geometry = {
        "layers": 32,
        "kv_heads": 8,
        "head_size": 128,
        "block_size": BLOCK,
        "num_blocks": num_blocks,
    }
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    results: dict[str, Any] = {"geometry": geometry, "token_bytes": TOKEN_BYTES, "sizes": []}
    shared_gpu = args.prefill_device == args.decode_device
    prefill = NodeProcess(
        "bench-p",
        args.log_dir,
        shared_gpu=shared_gpu,
        seed=1,
        device=args.prefill_device,
        chunk_bytes=chunk_sizes[-1],
        **geometry,
    )
    try:
        decode = NodeProcess(
            "bench-d",
            args.log_dir,
            shared_gpu=shared_gpu,
            seed=2,
            device=args.decode_device,
            chunk_bytes=chunk_sizes[-1],
            **geometry,
        )
    except BaseException:
        prefill.stop()
        raise
    try:
        peers = [{"instance_id": prefill.instance_id, "endpoint": prefill.endpoint}]
        pre = _ok(decode.call("preconnect", peers=[{**peers[0], "pulls_from": True}], timeout_s=60))
        results["preconnect_ms"] = pre["elapsed_s"] * 1e3
        results["idle_gap_ms"] = args.idle_gap_ms
        answered = time.monotonic()  # both nodes' instants are this host's monotonic clock
        time.sleep(args.idle_gap_ms / 1e3)
        first = _pull(decode, prefill, "first", [3], [5])
        results["first_pull_ms"] = first["elapsed_s"] * 1e3
        results["first_pull_connect_ms"] = first["connect_s"] * 1e3
        # the pair's idle time before the first pull: pre-connect's answer to the pull's start
        results["first_pull_gap_ms"] = (first["started"] - answered) * 1e3

        def one_block(transfer_id: str) -> dict[str, Any]:
            """One pull of a random prefill block into a random decode block."""
            got = _pull(
                decode,
                prefill,
                transfer_id,
                [rng.randrange(num_blocks)],
                [rng.randrange(num_blocks)],
            )
            return {**got, "transfer_id": transfer_id}

        one = [one_block(f"one{i}") for i in range(40)]
        # Later pulls through the same pair, each after the first pull's pause (idle threads,
        # caches and CPU as the first pull found them, minus first use).
        idle: list[dict[str, Any]] = []
        for i in range(args.idle_pulls):
            answered = time.monotonic()
            time.sleep(args.idle_gap_ms / 1e3)
            got = one_block(f"idle{i}")
            idle.append({**got, "gap_s": got["started"] - answered})
        raw_one = _raw(decode, prefill, TOKEN_BYTES * BLOCK, 20)
        pull_one = statistics.median(g["elapsed_s"] for g in one)
        results["one_block_pull_ms"] = pull_one * 1e3
        results["one_block_raw_ms"] = raw_one * 1e3
        results["one_block_pull_over_raw"] = pull_one / raw_one
        results["control_overhead_ms"] = (pull_one - raw_one) * 1e3
        results["first_over_later"] = first["elapsed_s"] / pull_one
        if idle:
            pull_idle = statistics.median(g["elapsed_s"] for g in idle)
            results["idle_later_pull_ms"] = pull_idle * 1e3
            results["idle_later_pulls_ms"] = [round(g["elapsed_s"] * 1e3, 3) for g in idle]
            results["idle_later_gap_ms"] = statistics.median(g["gap_s"] for g in idle) * 1e3
            results["first_over_idle_later"] = first["elapsed_s"] / pull_idle
            results["idle_later_breakdown_ms"] = _breakdown(idle, prefill)
        results["one_block_breakdown_ms"] = _breakdown(one, prefill)
        # the same phases of the first pull, to see which one a first use still pays
        results["first_pull_breakdown_ms"] = _breakdown(
            [{**first, "transfer_id": "first"}], prefill
        )
        for n_tokens in tokens:
            n = n_tokens // BLOCK
            nbytes = n * BLOCK * TOKEN_BYTES
            raw = _raw(decode, prefill, nbytes, args.repeats)
            row: dict[str, Any] = {
                "tokens": n_tokens,
                "blocks": n,
                "bytes": nbytes,
                "raw_s": raw,
                "raw_gbps": nbytes / raw / 1e9,
                "variants": {},
            }
            variants = [(f"gather-{c >> 20}MiB", {"chunk_bytes": c}) for c in chunk_sizes]
            for name, extra in variants:
                times, verified = [], True
                for r in range(args.repeats):
                    src, dst = rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)
                    got = _pull(decode, prefill, f"{name}-{n_tokens}-{r}", src, dst, **extra)
                    if got["bytes"] != nbytes:
                        raise RuntimeError(f"{name}: {got['bytes']} bytes, expected {nbytes}")
                    times.append(got["elapsed_s"])
                    if r == 0:
                        a = _ok(prefill.call("checksums", block_ids=src))["checksums"]
                        b = _ok(decode.call("checksums", block_ids=dst))["checksums"]
                        verified = a == b
                t = statistics.median(times)
                row["variants"][name] = {
                    "times_s": times,
                    "median_s": t,
                    "gbps": nbytes / t / 1e9,
                    "ratio_vs_raw": raw / t,
                    "checksums_equal": verified,
                }
            results["sizes"].append(row)
    finally:
        decode.stop()
        prefill.stop()
    print(
        f"pre-connect {results['preconnect_ms']:.1f} ms; first pull through it "
        f"{results['first_pull_ms']:.2f} ms ({results['first_over_later']:.2f} x later ones); "
        f"1-block pull {results['one_block_pull_ms']:.2f} ms (raw "
        f"{results['one_block_raw_ms']:.2f} ms, {results['one_block_pull_over_raw']:.2f} x): "
        f"control-plane overhead {results['control_overhead_ms']:.2f} ms/transfer"
    )
    print("where a 1-block pull's time goes (median ms):", results["one_block_breakdown_ms"])
    print("the first pull through the pre-connected pair (ms):", results["first_pull_breakdown_ms"])
    if "first_over_idle_later" in results:
        print(
            f"first pull {results['first_pull_ms']:.2f} ms after {results['first_pull_gap_ms']:.0f}"
            f" ms idle: first_over_later {results['first_over_later']:.2f} (back to back, "
            f"{results['one_block_pull_ms']:.2f} ms), first_over_idle_later "
            f"{results['first_over_idle_later']:.2f} (later pulls after the same pause, "
            f"{results['idle_later_pull_ms']:.2f} ms, {results['idle_later_gap_ms']:.0f} ms idle)"
        )
        print("a later pull after the same pause (median ms):", results["idle_later_breakdown_ms"])
    print(
        f"{'tokens':>7} {'MiB':>7} {'raw ms':>8} {'raw GB/s':>8}  {'variant':<20}"
        f" {'pull ms':>8} {'GB/s':>6} {'ratio':>6} ok"
    )
    for row in results["sizes"]:
        for name, v in row["variants"].items():
            print(
                f"{row['tokens']:>7} {row['bytes'] / 2**20:>7.0f} {row['raw_s'] * 1e3:>8.1f}"
                f" {row['raw_gbps']:>8.2f}  {name:<20} {v['median_s'] * 1e3:>8.1f}"
                f" {v['gbps']:>6.2f} {v['ratio_vs_raw']:>6.3f} {v['checksums_equal']}"
            )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    bad = [
        n for r in results["sizes"] for n, v in r["variants"].items() if not v["checksums_equal"]
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
