"""`pdplane up --queue-timeout-s 120` (real vLLM CPU, 1P1D) with its decode SIGKILLed under a
steady trickle of requests: how many answers were not 200 while `pdplane up` restarted it.

    .venv/bin/python bench/vllm_cpu/decode_restart.py [--rate 2] [--port-base 18000]

Starts `pdplane up` on ports from `--port-base` (logs in a temporary folder), sends a
completion (8 tokens; streamed and not, alternating) every 1/`--rate` s, SIGKILLs the process
serving the decode's HTTP port 5 s in, keeps sending until the decode has been healthy again
for 5 s, and prints the statuses, the SSE error events, and the longest answer time.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

_PDPLANE = str(Path(sys.executable).parent / "pdplane")


def _log(t0: float, *parts: object) -> None:
    print(f"[{time.time() - t0:6.1f} s]", *parts, flush=True)


def _listener_pids(port: int) -> list[int]:
    out = subprocess.run(
        ["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, check=False
    ).stdout
    return sorted({int(p) for p in re.findall(r"pid=(\d+)", out)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second")
    parser.add_argument("--port-base", type=int, default=18000)
    args = parser.parse_args()
    base = args.port_base
    gateway = f"http://127.0.0.1:{base}"
    logs = tempfile.mkdtemp(prefix="pdplane-decode-restart-")
    t0 = time.time()
    up = subprocess.Popen(
        [_PDPLANE, "up", "--queue-timeout-s", "120", "--gateway-port", str(base),
         "--registry-port", str(base + 51), "--scheduler-port", str(base + 52),
         "--scheduler-metrics-port", str(base + 53), "--vllm-base-port", str(base + 100),
         "--kv-base-port", str(base + 200), "--log-dir", logs],
        stdout=open(Path(logs) / "up.out", "w"),  # noqa: SIM115 (the process outlives a with)
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        while True:
            try:
                if httpx.get(f"{gateway}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if up.poll() is not None:
                raise SystemExit(f"pdplane up exited with {up.returncode}; see {logs}")
            time.sleep(2)
        model = next(iter(httpx.get(f"{gateway}/health", timeout=5).json()["models"]))
        _log(t0, f"1P1D up, model {model}")
        results: list[tuple[float, float, int, bool]] = []  # sent, seconds, status, error event
        stop = threading.Event()

        def one(i: int) -> None:
            stream = i % 2 == 1
            body = {
                "model": model,
                "prompt": f"Hello number {i}",
                "max_tokens": 8,
                "stream": stream,
            }
            sent = time.time()
            try:
                r = httpx.post(f"{gateway}/v1/completions", json=body, timeout=200)
                results.append((sent, time.time() - sent, r.status_code, b'"error"' in r.content))
            except httpx.HTTPError:
                results.append((sent, time.time() - sent, -1, False))

        def trickle() -> None:
            threads = []
            i = 0
            while not stop.is_set():
                threads.append(threading.Thread(target=one, args=(i,)))
                threads[-1].start()
                i += 1
                time.sleep(1 / args.rate)
            for t in threads:
                t.join(250)

        sender = threading.Thread(target=trickle)
        sender.start()
        time.sleep(5)
        decode_port = base + 101  # prefill-0 on the first vLLM port, decode-1 on the next
        for pid in _listener_pids(decode_port):
            os.kill(pid, signal.SIGKILL)
        killed = time.time()
        _log(t0, f"SIGKILLed the decode (port {decode_port})")
        time.sleep(3)
        while time.time() - killed < 300:
            try:
                if httpx.get(f"{gateway}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        _log(t0, f"decode healthy again {time.time() - killed:.0f} s after the kill")
        time.sleep(5)
        stop.set()
        sender.join(300)
        statuses: dict[int, int] = {}
        for _, _, status, _ in results:
            statuses[status] = statuses.get(status, 0) + 1
        after = sum(1 for sent, _, _, _ in results if sent >= killed)
        _log(
            t0,
            f"{len(results)} requests ({after} sent after the kill): statuses {statuses}, "
            f"non-2xx {sum(n for s, n in statuses.items() if not 200 <= s < 300)}, SSE error "
            f"events {sum(e for *_, e in results)}, longest answer "
            f"{max(s for _, s, _, _ in results):.1f} s",
        )
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
