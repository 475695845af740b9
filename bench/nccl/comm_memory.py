"""GPU memory per 2-rank NCCL communicator, as pdplane creates them (non-blocking, warmed up).

Two worker processes on one GPU (distinct NCCL_HOSTID: NCCL's socket transport between them,
as between two hosts) create N communicators with each other, exactly as a pair does
(`NcclCommunicator.start`, `wait_ready`, `warm_up`: the 4-byte exchange that makes NCCL build
its connections and buffers), for N = 8, 32, 128 in turn. Rank 0 reads the device's free
memory (`torch.cuda.mem_get_info`) before the first and after each step; both ranks live on the
same GPU, so a step's drop covers both ranks: per communicator and rank = drop / (2 N). Each
NCCL setting (`--variants`: environment assignments, e.g. NCCL_MAX_NCHANNELS=2) runs in fresh
processes.

    python bench/nccl/comm_memory.py --out mem.json
    python bench/nccl/comm_memory.py --counts 8,32,128 --variants "default;NCCL_BUFFSIZE=1048576"

Prints a table; `--out` writes every number as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # stdlib only: runs without the checkout on the path

MIB = 1 << 20


# -- worker (one rank of every communicator) ----------------------------------------------------


def _worker(rank: int) -> int:
    import torch

    from pdplane.connector.transports.nccl.binding import NcclLibrary
    from pdplane.connector.transports.nccl.communicator import NcclCommunicator

    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda:0")  # the CUDA context exists before the baseline
    torch.cuda.synchronize()
    lib = NcclLibrary.get()
    comms: list[Any] = []

    def answer(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    answer({"ready": True, "nccl": lib.version})
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg["op"]
        if op == "mem":
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info(0)
            answer({"free": free, "total": total})
        elif op == "ids":  # rank 0: new unique ids
            answer({"ids": [lib.get_unique_id().hex() for _ in range(msg["n"])]})
        elif op == "start":
            started = [
                NcclCommunicator.start(bytes.fromhex(u), rank, 0, f"m{i}", lib)
                for i, u in enumerate(msg["ids"])
            ]
            deadline = time.monotonic() + 300
            for comm in started:
                comm.wait_ready(deadline)
            for comm in started:
                comm.warm_up(deadline)
            comms.extend(started)
            answer({"count": len(comms)})
        elif op == "exit":
            break
    # No teardown: aborting 128 communicators one by one outlasted the run's time bound, and
    # the process's end frees their memory anyway.
    sys.stdout.flush()
    os._exit(0)


# -- driver ------------------------------------------------------------------------------------


class _Rank:
    def __init__(self, rank: int, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(rank)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.hello = self.recv()

    def send(self, **msg: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def recv(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"rank exited ({self.proc.poll()})")
        return dict(json.loads(line))

    def call(self, **msg: Any) -> dict[str, Any]:
        self.send(**msg)
        return self.recv()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="exit")
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def _variant(name: str, counts: list[int], deadline: float) -> dict[str, Any]:
    env = dict(os.environ)
    env["NCCL_NVLS_ENABLE"] = "0"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "services"), str(ROOT / "connector"), env.get("PYTHONPATH", "")]
    )
    settings = {}
    if name != "default":
        for assignment in name.split(","):
            key, _, value = assignment.partition("=")
            settings[key.strip()] = value.strip()
    env.update(settings)
    ranks = []
    try:
        for rank in (0, 1):
            ranks.append(_Rank(rank, {**env, "NCCL_HOSTID": f"pdplane-mem-{rank}"}))
        base = ranks[0].call(op="mem")
        rows, made = [], 0
        for n in counts:
            if time.monotonic() > deadline:
                print(f"{name}: out of time before {n} communicators", flush=True)
                break
            t0 = time.monotonic()
            ids = ranks[0].call(op="ids", n=n - made)["ids"]
            for r in ranks:  # both ranks start their inits before either waits
                r.send(op="start", ids=ids)
            for r in ranks:
                r.recv()
            made = n
            now = ranks[0].call(op="mem")
            used = base["free"] - now["free"]
            row = {
                "communicators": n,
                "gpu_bytes_both_ranks": used,
                "per_communicator_per_rank_mib": used / (2 * n) / MIB,
                "setup_s": time.monotonic() - t0,
            }
            rows.append(row)
            print(
                f"{name:<28} {n:>6} {used / MIB:>15.1f}"
                f" {row['per_communicator_per_rank_mib']:>14.2f} {row['setup_s']:>6.1f}",
                flush=True,
            )
        if not rows:
            return {"variant": name, "settings": settings, "rows": []}
        if len(rows) > 1:  # the marginal cost, without what NCCL sets up once per process
            a, b = rows[0], rows[-1]
            delta = b["gpu_bytes_both_ranks"] - a["gpu_bytes_both_ranks"]
            marginal = delta / (2 * (b["communicators"] - a["communicators"])) / MIB
        else:
            marginal = rows[0]["per_communicator_per_rank_mib"]
        return {
            "variant": name,
            "settings": settings,
            "nccl": ranks[0].hello.get("nccl"),
            "gpu_total_bytes": base["total"],
            "rows": rows,
            "marginal_per_communicator_per_rank_mib": marginal,
        }
    finally:
        for r in ranks:
            r.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--counts", default="8,32,128")
    p.add_argument(
        "--variants",
        default="default;NCCL_MAX_NCHANNELS=2;NCCL_BUFFSIZE=1048576",
        help="';'-separated NCCL settings, each 'default' or comma-separated KEY=VALUE",
    )
    p.add_argument("--cap", type=int, default=64, help="max_peer_communicators to price")
    p.add_argument("--budget-s", type=float, default=100.0, help="stop starting steps after")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.worker is not None:
        return _worker(args.worker)
    counts = [int(c) for c in args.counts.split(",")]
    deadline = time.monotonic() + args.budget_s
    print(f"{'variant':<28} {'comms':>6} {'GPU MiB (both)':>15} {'MiB/comm/rank':>14} {'s':>6}")
    results = []
    for v in (v.strip() for v in args.variants.split(";")):
        if not v or time.monotonic() > deadline:
            continue
        r = _variant(v, counts, deadline)
        results.append(r)
        if r["rows"]:
            per = r["marginal_per_communicator_per_rank_mib"]
            r["at_cap_mib_per_worker"] = per * args.cap
            print(
                f"{r['variant']:<28} marginal {per:.2f} MiB per communicator and rank; "
                f"at max_peer_communicators={args.cap}: {per * args.cap:.0f} MiB per worker",
                flush=True,
            )
        if args.out:  # after every variant: a run cut short keeps what it measured
            args.out.write_text(json.dumps({"cap": args.cap, "variants": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
