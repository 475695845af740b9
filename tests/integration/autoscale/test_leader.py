"""One controller at a time: the autoscaler's leader lease on a real etcd (one member on
loopback, data on tmpfs)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdplane.autoscale.leader import EtcdLeader
from pdplane.launch.etcd import EtcdCluster, etcd_binary
from pdplane.registry.etcd.client import parse_endpoints


@pytest.fixture(scope="module")
def endpoints() -> Iterator[list[str]]:
    if etcd_binary() is None:
        pytest.fail("etcd is not installed (apt-get install etcd-server)")
    shm = Path("/dev/shm")
    data = Path(tempfile.mkdtemp(prefix="pdplane-etcd-", dir=shm if shm.is_dir() else None))
    cluster = EtcdCluster(data, size=1)
    cluster.start()
    try:
        yield parse_endpoints(cluster.endpoints)
    finally:
        cluster.stop()


def test_one_replica_leads_and_another_takes_over_when_it_stops(endpoints: list[str]) -> None:
    key = "/pdplane/autoscale/m/leader"
    a = EtcdLeader(endpoints, key, ttl_s=10, identity="a")
    b = EtcdLeader(endpoints, key, ttl_s=10, identity="b")
    try:
        assert a.is_leader()
        assert not b.is_leader()
        assert a.is_leader() and not b.is_leader()  # renewing keeps it
        a.close()  # revokes its lease: the key goes with it
        assert b.is_leader()
    finally:
        b.close()


def test_no_etcd_means_not_leading() -> None:
    lost = EtcdLeader(["127.0.0.1:1"], "/pdplane/autoscale/m/leader", ttl_s=10)
    try:
        assert not lost.is_leader()
    finally:
        lost.close()
