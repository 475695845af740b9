"""The sim publishes its prefix cache as the connector does: KvEvents.Subscribe at kv_endpoint."""

from __future__ import annotations

import threading

import grpc
import httpx

from pdplane.core import prefix_hash
from pdplane.core.grpc import util as grpc_util
from pdplane.scheduler.kv_index.stream import KvStreamReader
from pdplane.sim.testing import running_sims
from pdplane.sim.tokens import WordTokenizer
from pdplane.v1 import kv_events_pb2_grpc
from tests.integration.sim.helpers import wait_for
from tests.support.kv_replica import Replica

PROMPT = " ".join(f"word{i}" for i in range(40))


def _follow(endpoint: str, replica: Replica) -> tuple[threading.Thread, grpc.Channel]:
    channel = grpc_util.channel(endpoint)
    stub = kv_events_pb2_grpc.KvEventsStub(channel)
    reader = KvStreamReader(replica)
    stream = stub.Subscribe(reader.request("test"))

    def run() -> None:
        try:
            for msg in stream:
                reader.feed(msg)
        except grpc.RpcError:
            pass  # the channel closed at the end of the test

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, channel


def test_kv_events_mirror_the_prefix_cache_and_hash_like_the_scheduler() -> None:
    with running_sims("both", block_size=8, kv_blocks=8, max_model_len=64) as sims:
        sim = sims[0]
        replica = Replica()
        _, channel = _follow(sim.kv_endpoint, replica)
        try:
            body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 1}
            assert httpx.post(sim.url + "/v1/completions", json=body).status_code == 200
            # 40 prompt tokens = 5 full blocks of 8
            wait_for(lambda: len(replica.blocks) == 5)
            ids = WordTokenizer().encode(PROMPT)
            stored = sorted(replica.blocks.values(), key=lambda v: ids.index(v[1][0]))
            assert [list(tokens) for _, tokens in stored] == [
                ids[i : i + 8] for i in range(0, 40, 8)
            ]
            # The scheduler's own keys from the events' tokens equal the gateway's from the prompt.
            chain = []
            parent = None
            for _, tokens in stored:
                parent = prefix_hash.block_hashes(list(tokens), 8, parent=parent)[0]
                chain.append(parent)
            assert chain == prefix_hash.block_hashes(ids, 8)
            # Another prompt of 5 blocks evicts the first (8 blocks in all): BlockRemoved.
            other = {**body, "prompt": " ".join(f"other{i}" for i in range(40))}
            assert httpx.post(sim.url + "/v1/completions", json=other).status_code == 200
            wait_for(lambda: len(replica.blocks) == 8)
            httpx.post(sim.url + "/reset_prefix_cache")
            wait_for(lambda: not replica.blocks)
        finally:
            channel.close()
