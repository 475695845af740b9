"""Client CPU per relayed request of the gateway's upstream client, this tree vs another.

`bench/relay.py` measures a whole proxy; this isolates the gateway's two upstream legs as the
relay drives them (`pdplane.gateway.upstream.UpstreamClient`): per request, a prefill leg (POST,
one JSON answer with `kv_transfer_params`, parsed) and a decode leg (POST, an SSE stream of
`--events` events read with the stream idle bound), `--concurrency` at a time, on uvloop.
The upstream is one aiohttp server in its own process (its CPU is not counted). The number is
the client process's CPU time (`time.process_time`) per request, in microseconds.

Side by side: with `--base-tree DIR` (a checkout, e.g. `git archive main | tar -x -C DIR`)
rounds alternate between a client running DIR's code and one running this tree's, over the
same server; the report is each side's median over `--rounds` and how many rounds were lower.

    python bench/upstream_client.py --base-tree /tmp/base --rounds 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._procs import free_port  # noqa: E402

_KV = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "e" * 32,
    "remote_block_ids": list(range(8)),
    "remote_host": "127.0.0.1",
    "remote_port": 5555,
    "transfer_id": "t" * 36,
}


def _serve(port: int, events: int, gap_s: float) -> None:
    import uvloop
    from aiohttp import web

    answer = json.dumps({"choices": [{"text": "a"}], "kv_transfer_params": _KV}).encode()
    sse = [
        b'data: {"choices":[{"index":0,"delta":{"content":"t%d"}}]}\n\n' % i
        for i in range(events - 1)
    ] + [b"data: [DONE]\n\n"]

    async def prefill(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type="application/json")

    async def decode(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in sse:
            await resp.write(event)
            await asyncio.sleep(gap_s)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/prefill", prefill)
    app.router.add_post("/decode", decode)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def _drive(url: str, requests: int, concurrency: int) -> float:
    """CPU us per request of `requests` relayed requests (after a warm-up of 200)."""
    from pdplane.gateway.upstream import UpstreamClient

    client = UpstreamClient()
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "w " * 100}], "stream": True}
    ).encode()
    headers = {"content-type": "application/json", "x-request-id": "r"}
    slots = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with slots:
            resp = await client.open(
                url + "/prefill", body, headers, read_timeout_s=300.0, total_timeout_s=300.0
            )
            kv = json.dumps(json.loads(await client.read(resp))["kv_transfer_params"])
            resp = await client.open(
                url + "/decode",
                body[:-1] + b',"kv_transfer_params":' + kv.encode() + b"}",
                headers,
                read_timeout_s=300.0,
            )
            async for _ in resp.chunks(30.0):
                pass
            resp.release()

    await asyncio.gather(*(one() for _ in range(200)))
    t0 = time.process_time()
    await asyncio.gather(*(one() for _ in range(requests)))
    cpu_us = (time.process_time() - t0) / requests * 1e6
    await client.close()
    return cpu_us


def _round(tree: Path, url: str, args: argparse.Namespace) -> float:
    env = {**os.environ, "PYTHONPATH": f"{tree}/services:{tree}/connector:{ROOT}"}
    argv = [sys.executable, __file__, "--drive", url, "--requests", str(args.requests)]
    argv += ["--concurrency", str(args.concurrency)]
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-tree", default="", help="checkout to compare with (side by side)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=1000, help="measured requests per round")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--events", type=int, default=17, help="SSE events per decode stream")
    parser.add_argument("--gap-ms", type=float, default=0.5, help="server pause between events")
    parser.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--drive", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _serve(args.serve, args.events, args.gap_ms / 1000)
        return
    if args.drive:
        import uvloop

        uvloop.install()
        print(f"{asyncio.run(_drive(args.drive, args.requests, args.concurrency)):.1f}")
        return

    port = free_port()
    serve = ["--serve", str(port), "--events", str(args.events), "--gap-ms", str(args.gap_ms)]
    server = subprocess.Popen([sys.executable, __file__, *serve])
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_listening(port)
        trees = {"this tree": ROOT}
        if args.base_tree:
            trees = {"base": Path(args.base_tree).resolve(), **trees}
        results: dict[str, list[float]] = {name: [] for name in trees}
        for i in range(args.rounds):
            order = list(trees) if i % 2 == 0 else list(reversed(trees))
            for name in order:
                results[name].append(_round(trees[name], url, args))
        for name, values in results.items():
            shown = " ".join(f"{v:.0f}" for v in values)
            print(f"{name}: median {statistics.median(values):.1f} us/request ({shown})")
        if args.base_tree:
            base, new = results["base"], results["this tree"]
            ratio = statistics.median(new) / statistics.median(base)
            lower = sum(n < b for b, n in zip(base, new, strict=True))
            print(f"this tree / base = {ratio:.3f}; lower in {lower} of {args.rounds} rounds")
    finally:
        server.terminate()
        server.wait()


def _wait_listening(port: int, timeout_s: float = 10.0) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"upstream server not listening on {port} after {timeout_s} s")


if __name__ == "__main__":
    main()
