"""`pdplane ls` shows the scheduler's prefix index state of each instance (KV_INDEX)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from pdplane.cli import fleet_credentials, ls
from pdplane.launch.ports import free_port_run
from pdplane.scheduler.kv_index import KvState
from tests.integration.kv_events.helpers import TOKEN, Engine, tokens, waited
from tests.integration.registry.fixtures import make_spec, running_registry_server
from tests.integration.scheduler.fixtures import running_scheduler_server


def _ls(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    code = ls.main(list(args), out=out)
    return code, out.getvalue()


def test_ls_kv_index_column_follows_live_and_stale(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDPLANE_CACHE_DIR", str(tmp_path))
    engine = Engine("p0")
    try:
        engine.store(tokens(0, 3))
        with running_registry_server() as registry:
            spec = make_spec("p0", kv_endpoint=f"127.0.0.1:{engine.port}")
            registry.store.register(spec, 60_000)
            registry.store.register(make_spec("d0", kv_endpoint=""), 60_000)
            with running_scheduler_server(registry.address, token=TOKEN) as sched:
                manager = sched.app.kv_index
                assert manager is not None and manager.wait_live(10, {"p0"})
                base = ("--registry", registry.address, "--scheduler", sched.address)
                code, text = _ls(*base, "--token", TOKEN)
                lines = text.splitlines()
                assert code == 0
                assert lines[0].split()[:5] == ["ID", "ROLE", "MODEL", "STATE", "KV_INDEX"]
                rows = {line.split()[0]: line.split()[4] for line in lines[1:]}
                assert rows == {"d0": "-", "p0": "live"}  # d0 has no KV endpoint: not followed
                code, text = _ls(*base, "--token", TOKEN, "--json")
                p0 = next(v for v in json.loads(text) if v["id"] == "p0")
                assert p0["kv_index"]["state"] == "live" and p0["kv_index"]["blocks"] == 3
                # Without --scheduler, the local `pdplane up` fleet's scheduler (from its
                # credentials file) when --registry is its registry, whatever its port.
                creds = fleet_credentials.FleetCredentials(
                    registry.address, TOKEN, "admin", (sched.address,), sched.address
                )
                fleet_credentials.write(creds)
                try:
                    code, text = _ls("--registry", registry.address)
                finally:
                    fleet_credentials.remove(creds)
                rows = {line.split()[0]: line.split()[4] for line in text.splitlines()[1:]}
                assert code == 0 and rows == {"d0": "-", "p0": "live"}

                engine.stop()  # its stream dies: stale at once, routed by load
                waited(lambda: {s.state for s in manager.states()} == {KvState.STALE})
                code, text = _ls(*base, "--token", TOKEN, "--json")
                p0 = next(v for v in json.loads(text) if v["id"] == "p0")
                assert p0["kv_index"]["state"] == "stale"
                assert p0["kv_index"]["reason"].startswith("stream")

                # A wrong token: the listing still succeeds, the column says it does not know.
                code, text = _ls(*base, "--scheduler-token", "wrong")
                assert code == 0 and text.splitlines()[1].split()[4] == "?"
                assert "UNAUTHENTICATED" in capsys.readouterr().err
            # No scheduler there: same; `--scheduler ""` leaves the column out.
            code, text = _ls(
                "--registry", registry.address, "--scheduler", f"127.0.0.1:{free_port_run()}"
            )
            assert code == 0 and text.splitlines()[1].split()[4] == "?"
            assert "UNAVAILABLE" in capsys.readouterr().err
            code, text = _ls("--registry", registry.address, "--scheduler", "")
            assert code == 0 and "KV_INDEX" not in text
    finally:
        engine.stop()


def test_ls_says_off_when_the_scheduler_has_no_index() -> None:
    with running_registry_server() as registry:
        registry.store.register(make_spec("p0"), 60_000)
        with running_scheduler_server(registry.address, kv_index=False) as sched:
            code, text = _ls("--registry", registry.address, "--scheduler", sched.address)
    assert code == 0 and text.splitlines()[1].split()[4] == "off"
