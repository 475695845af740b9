"""A registry restarted on the same port gets every client-library instance back within 2 s,
with no action by its owner, and watchers' views follow. On etcd the instances never leave:
the restarted replica finds them in etcd and takes their heartbeats over, without a
re-registration, and a watcher resumes where it was, without a snapshot."""

from __future__ import annotations

import time

import pytest

from pdplane.launch.ports import free_port_run
from pdplane.registry.client import InstanceWatcher, RegistrationClient
from pdplane.v1 import instance_pb2
from tests.integration.registry.conftest import wait_until
from tests.integration.registry.fixtures import make_spec, running_registry_server


@pytest.mark.parametrize("downtime_s", [0.3, 3.0])
def test_instances_come_back_after_registry_restart(downtime_s: float, registry_store: str) -> None:
    port = free_port_run()
    clients = [RegistrationClient(f"127.0.0.1:{port}", make_spec(f"p{i}")) for i in range(3)] + [
        RegistrationClient(f"127.0.0.1:{port}", make_spec("d0", instance_pb2.ROLE_DECODE))
    ]
    watcher = InstanceWatcher(f"127.0.0.1:{port}")
    ids = {c.instance_id for c in clients}
    try:
        # Default lease TTL (5 s) and heartbeat (1 s), as deployed.
        with running_registry_server(port) as first:
            for c in clients:
                c.start()
            watcher.start()
            assert all(c.wait_registered(5) for c in clients)
            assert wait_until(lambda: set(watcher.snapshot()) == ids, 5)
            revision_before = watcher.revision
        assert first.store.list()[0]  # the old registry held them until it stopped
        time.sleep(downtime_s)  # the registry is down (the clients' retries back off meanwhile)

        with running_registry_server(port) as second:
            started, restarted_ns = time.monotonic(), time.time_ns()
            back = wait_until(lambda: len(second.store.list()[0]) == len(ids), 2.0)
            elapsed = time.monotonic() - started
            assert back, f"only {len(second.store.list()[0])} back after {elapsed:.2f} s"
            assert {i.spec.instance_id for i in second.store.list()[0]} == ids
            # The watcher kept its last view meanwhile and then converged on the new registry.
            assert wait_until(lambda: watcher.revision == second.store.revision, 3)
            assert set(watcher.snapshot()) == ids
            if registry_store == "memory":
                # Listed once the registry answered; the client counts once it read the answer.
                assert wait_until(lambda: all(c.registrations == 2 for c in clients), 2)
                assert watcher.revision > revision_before
                assert watcher.snapshots >= 2
            else:
                # Heartbeats answered by the new replica (it took the leases over), none lost.
                def beating() -> bool:
                    listed = second.store.list()[0]
                    return all(i.last_heartbeat.ToNanoseconds() > restarted_ns for i in listed)

                assert wait_until(beating, 3)
                assert all(c.registrations == 1 for c in clients)
                assert watcher.revision >= revision_before
            for c in clients:  # while the registry is up, so that they deregister at once
                c.stop()
    finally:
        for c in clients:
            c.stop()
        watcher.stop()


def test_watcher_serves_last_view_while_registry_is_down() -> None:
    port = free_port_run()
    client = RegistrationClient(f"127.0.0.1:{port}", make_spec("p0"))
    watcher = InstanceWatcher(f"127.0.0.1:{port}")
    try:
        with running_registry_server(port):
            client.start()
            watcher.start()
            assert wait_until(lambda: "p0" in watcher.snapshot(), 5)
        # Registry gone: the view stays as it was, and the watcher keeps trying.
        reconnects = watcher.reconnects
        assert wait_until(lambda: watcher.reconnects > reconnects + 1, 5)
        assert set(watcher.snapshot()) == {"p0"}
    finally:
        client.stop()
        watcher.stop()
