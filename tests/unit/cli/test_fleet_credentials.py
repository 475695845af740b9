"""Two `pdplane up` fleets on one machine (on different ports) keep their own credentials: the
local tools find each fleet's tokens by its address, whichever started last, and a fleet that
stops removes only its own."""

from __future__ import annotations

import dataclasses
import stat
import subprocess
from pathlib import Path

import pytest

from pdplane.cli import fleet_credentials as fc


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDPLANE_CACHE_DIR", str(tmp_path))
    return tmp_path


def _fleet(port: int) -> fc.FleetCredentials:
    return fc.generate(f"127.0.0.1:{port}", (f"127.0.0.1:{port + 1}",))


def test_a_second_fleet_does_not_hide_the_first_one_s_tokens() -> None:
    first, second = _fleet(8051), _fleet(9051)
    fc.write(first)
    fc.write(second)
    assert fc.for_registry("127.0.0.1:8051") == first
    assert fc.for_registry("127.0.0.1:9051") == second
    assert fc.token_for("127.0.0.1:8052", None) == first.token  # its scheduler
    assert fc.token_for("127.0.0.1:8051", None, admin=True) == first.admin_token
    assert fc.token_for("127.0.0.1:9052", None) == second.token
    # The file scripts read (`jq -r .token`) names the fleet started last.
    assert fc.local() == second


def test_a_fleet_that_stops_removes_its_own_credentials_only() -> None:
    first, second = _fleet(8051), _fleet(9051)
    fc.write(first)
    fc.write(second)
    fc.remove(second)
    assert fc.for_registry("127.0.0.1:9051") is None
    assert fc.for_registry("127.0.0.1:8051") == first
    assert fc.local() == first  # the one still running is the local fleet again
    fc.remove(first)
    assert fc.local() is None
    assert fc.for_registry("127.0.0.1:8051") is None


def test_a_restarted_fleet_on_the_same_registry_replaces_its_old_credentials() -> None:
    old, new = _fleet(8051), _fleet(8051)
    fc.write(old)
    fc.write(new)
    assert fc.for_registry("127.0.0.1:8051") == new
    fc.remove(old)  # a late stop of the old run leaves the new one's alone
    assert fc.for_registry("127.0.0.1:8051") == new


def test_every_credentials_file_is_readable_by_its_user_only(cache_dir: Path) -> None:
    fc.write(_fleet(8051))
    files = [p for p in cache_dir.rglob("*") if p.is_file()]
    assert files
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for folder in [p for p in cache_dir.rglob("*") if p.is_dir()]:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_fleet_killed_without_its_cleanup_is_ignored_and_never_named_the_local_one() -> None:
    first = _fleet(8051)
    killed = dataclasses.replace(_fleet(9051), pid=_dead_pid())  # SIGKILLed: files left
    fc.write(first)
    fc.write(killed)
    assert fc.for_registry("127.0.0.1:9051") is None  # its token goes nowhere
    assert fc.token_for("127.0.0.1:9052", None) is None
    assert fc.local() == first
    fc.remove(first)
    assert fc.local() is None  # not the dead fleet's file
    assert not fc.credentials_path().exists()


def test_localhost_names_the_same_registry_as_127_0_0_1() -> None:
    creds = _fleet(8051)
    fc.write(creds)
    assert fc.for_registry("localhost:8051") == creds
    assert fc.token_for("localhost:8052", None) == creds.token


def test_a_refusal_says_which_fleets_run_here_and_how_to_give_a_token() -> None:
    fc.write(_fleet(8051))
    other = fc.unauthenticated_hint("127.0.0.1:9051")
    assert "no token known for 127.0.0.1:9051" in other
    assert "--token or --token-file" in other and "127.0.0.1:8051" in other
    ours = fc.unauthenticated_hint("localhost:8051", "--admin-token or --admin-token-file")
    assert "sent and refused" in ours and "--admin-token" in ours
