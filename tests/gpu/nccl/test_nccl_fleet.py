"""The NCCL path at fleet scale, on the GPU: pairs capped per worker (eviction while transfers
go on), pre-connected pairs, and peers that leave the registry (killed or drained).

KV node processes as in test_nccl_transfer.py (tests/support/nccl_node.py, distinct
NCCL_HOSTID); the registry runs in the test process.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from tests.gpu.nccl.helpers import NUM_BLOCKS, SMALL, block_sums, check_pull, ok
from tests.integration.registry.fixtures import running_registry

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

TTL_MS = 1000


def _comms(node: Any) -> dict[str, Any]:
    return ok(node.call("comms"))


def _wait_comms(node: Any, cond: Any, timeout: float, what: str) -> dict[str, Any]:
    t0 = time.monotonic()
    while True:
        got = _comms(node)
        if cond(got):
            return got
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"{what}: not within {timeout} s: {got}")
        time.sleep(0.05)


def test_more_peers_than_the_cap_evicts_idle_pairs_and_fails_no_transfer(
    start_node: Any,
) -> None:
    rng = random.Random(5)
    prefills = [start_node(f"p{i}", seed=i + 1, **SMALL) for i in range(4)]
    decode = start_node("d0", seed=9, max_peer_communicators=2, **SMALL)
    pulls, expected = [], []
    for k in range(24):
        p = prefills[k % len(prefills)]
        held = rng.sample(range(NUM_BLOCKS), 4)
        local = rng.sample(range(4 * k, 4 * k + 4), 4)  # disjoint: every pull is checked
        ok(p.call("hold", transfer_id=f"t{k}", block_ids=held))
        pulls.append(
            {
                "endpoint": p.endpoint,
                "peer_id": p.instance_id,
                "transfer_id": f"t{k}",
                "block_indices": list(range(4)),
                "local_ids": local,
                "timeout_s": 60,
            }
        )
        expected.append((p, held, local))
    answer = ok(decode.call("pulls", pulls=pulls, concurrency=3, timeout=300))
    assert answer["failed"] == 0, [a for a in answer["answers"] if a.get("ok") is False]
    for p, held, local in expected:
        assert block_sums(decode, local) == block_sums(p, held)
    stats = _comms(decode)["stats"]
    assert stats["communicators_evicted"] >= 2 and stats["communicators_failed"] == 0
    assert stats["communicators"] <= 2
    assert all(_comms(p)["stats"]["communicators_failed"] == 0 for p in prefills)


def test_a_preconnected_pair_costs_the_first_pull_no_handshake(start_node: Any) -> None:
    prefill = start_node("p0", seed=1, **SMALL)
    decode = start_node("d0", seed=2, **SMALL)
    peers = [{"instance_id": "p0", "endpoint": prefill.endpoint, "pulls_from": True}]
    assert ok(decode.call("preconnect", peers=peers, timeout_s=30))["opened"] == 1
    ok(prefill.call("hold", transfer_id="t0", block_ids=[5]))
    first = ok(
        decode.call(
            "pull",
            endpoint=prefill.endpoint,
            peer_id="p0",
            transfer_id="t0",
            block_indices=[0],
            local_ids=[7],
            timeout_s=30,
        )
    )
    assert first["connect_s"] == 0
    assert block_sums(decode, [7]) == block_sums(prefill, [5])


def test_a_new_prefill_asks_its_decodes_to_connect(start_node: Any) -> None:
    decode = start_node("d0", seed=2, **SMALL)
    prefill = start_node("p0", seed=1, **SMALL)
    peers = [{"instance_id": "d0", "endpoint": decode.endpoint, "serves_to": True}]
    assert ok(prefill.call("preconnect", peers=peers, timeout_s=30))["opened"] == 1
    assert _comms(decode)["comms"]["active"] == {"p0#0/pull": "ready"}
    check_pull(decode, prefill, "t", random.Random(4))


def test_peers_killed_or_drained_lose_their_communicators_within_the_ttl(
    start_node: Any,
) -> None:
    with running_registry(lease_ttl_ms=TTL_MS, heartbeat_interval_ms=300) as registry:
        reg = {"registry": registry, "lease_ttl_ms": TTL_MS}
        decode = start_node("d0", seed=2, role="decode", **reg, **SMALL)
        killed = start_node("p0", seed=1, role="prefill", **reg, **SMALL)
        drained = start_node("p1", seed=3, role="prefill", **reg, **SMALL)
        # the new prefills asked the decode to connect before they registered
        both = {"p0#0/pull", "p1#0/pull"}
        _wait_comms(decode, lambda c: set(c["comms"]["active"]) == both, 30, "pairs up")
        check_pull(decode, killed, "k", random.Random(1))
        check_pull(decode, drained, "d", random.Random(2))
        # killed: its streams break at once, and the registry removes it at lease expiry
        t0 = time.monotonic()
        killed.kill()
        _wait_comms(decode, lambda c: "p0#0/pull" not in c["comms"]["active"], 5, "p0 gone")
        gone = _wait_comms(decode, lambda c: len(c["gone"]) >= 1, 5, "p0 left the registry")
        assert gone["gone"][0]["peer"] == "p0"
        assert time.monotonic() - t0 < TTL_MS / 1000 + 2.0
        # drained: deregistered with drain, gone once idle; its pair with decode stays up
        # until then and is dropped when it leaves the registry
        t0 = time.monotonic()
        ok(drained.call("deregister", drain=True, timeout=30))
        after = _wait_comms(decode, lambda c: len(c["gone"]) >= 2, 5, "p1 left the registry")
        assert time.monotonic() - t0 < TTL_MS / 1000 + 2.0
        assert after["gone"][1] == {
            "event": "peer_gone",
            "peer": "p1",
            "dropped": {"communicators": 1, "pushed": 0},
            "drop_s": after["gone"][1]["drop_s"],
        }
        assert after["comms"]["active"] == {}
        assert after["stats"]["communicators_dropped"] == 1  # the metric
        _wait_comms(drained, lambda c: c["comms"]["active"] == {}, 5, "p1's side gone")
