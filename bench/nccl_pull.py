"""NCCL pull benchmark: pdplane's pull of paged KV blocks vs raw NCCL send/recv, same run.

Two KV node processes (bench/nccl_node.py) on the GPU(s) hold a Llama-3-8B-shaped KV cache
(32 layers, 8 KV heads, head 128, bf16, block 16 tokens: 128 KiB per token) in FlashAttention
layout. For each prompt length, decode pulls a random, non-contiguous set of prefill blocks into
random decode blocks (gRPC control + NCCL data), and the same number of bytes is sent raw
between the same two ranks as one contiguous buffer. Also measured: the control-plane overhead
per transfer (a 1-block pull, dominated by the gRPC round trip and the waits) and the first
connect. Bytes are verified by per-block checksums (first repeat of each variant and size).

    python bench/nccl_pull.py --out results.json            # one GPU: NCCL socket transport
    python bench/nccl_pull.py --decode-device 1 ...         # two GPUs: NVLink / P2P

Prints a table; `--out` writes every number as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nccl_cluster import NodeProcess

TOKEN_BYTES = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x heads x head size x bf16
BLOCK = 16


def _ok(answer: dict[str, Any]) -> dict[str, Any]:
    if answer.get("ok") is not True:
        raise RuntimeError(f"node answered {answer}")
    return answer


def _raw(decode: NodeProcess, prefill: NodeProcess, nbytes: int, iters: int) -> float:
    # Both ranks run their half at once; the node times from a joint 4-byte exchange.
    decode.send(
        "raw", peer=prefill.endpoint, is_send=False, nbytes=nbytes, iters=iters, timeout_s=120
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
            transfer_id=tid,
            block_indices=list(range(len(src))),
            local_ids=dst,
            timeout_s=300,
            **extra,
        )
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1024,8192,32768")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-device", type=int, default=0)
    p.add_argument("--decode-device", type=int, default=0)
    p.add_argument("--chunk-mib", default="64,256", help="gather staging sizes to compare")
    p.add_argument(
        "--grouped-max-tokens",
        type=int,
        default=8192,
        help="measure the grouped strategy up to this prompt length",
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
        first = _pull(decode, prefill, "connect", [3], [5])
        results["first_pull_with_connect_ms"] = first["elapsed_s"] * 1e3
        results["connect_ms"] = first["connect_s"] * 1e3
        one, posted = [], []
        for i in range(20):
            got = _pull(
                decode,
                prefill,
                f"one{i}",
                [rng.randrange(num_blocks)],
                [rng.randrange(num_blocks)],
            )
            one.append(got["elapsed_s"])
            posted.append(got["post_s"])
        raw_one = _raw(decode, prefill, TOKEN_BYTES * BLOCK, 10)
        results["one_block_pull_ms"] = statistics.median(one) * 1e3
        results["one_block_raw_ms"] = raw_one * 1e3
        # until decode's receives are posted: the request and prefill's acceptance (one gRPC
        # round trip) plus the planning
        results["one_block_post_ms"] = statistics.median(posted) * 1e3
        results["control_overhead_ms"] = (statistics.median(one) - raw_one) * 1e3
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
            variants: list[tuple[str, dict[str, Any], bool]] = [
                (f"gather-{c >> 20}MiB", {"strategy": "gather", "chunk_bytes": c}, False)
                for c in chunk_sizes
            ]
            if n_tokens <= args.grouped_max_tokens:
                variants += [
                    ("grouped-random", {"strategy": "grouped"}, False),
                    ("grouped-contiguous", {"strategy": "grouped"}, True),
                ]
            for name, extra, contiguous in variants:
                times, verified = [], True
                for r in range(args.repeats):
                    if contiguous:
                        s0, d0 = rng.randrange(num_blocks - n), rng.randrange(num_blocks - n)
                        src, dst = list(range(s0, s0 + n)), list(range(d0, d0 + n))
                    else:
                        src, dst = (
                            rng.sample(range(num_blocks), n),
                            rng.sample(range(num_blocks), n),
                        )
                    if extra.get("strategy") == "grouped":
                        extra = {**extra, "remote_ids": src}
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
        f"connect {results['connect_ms']:.1f} ms; 1-block pull "
        f"{results['one_block_pull_ms']:.2f} ms (raw {results['one_block_raw_ms']:.2f} ms, "
        f"receives posted after {results['one_block_post_ms']:.2f} ms): "
        f"control-plane overhead {results['control_overhead_ms']:.2f} ms/transfer"
    )
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
