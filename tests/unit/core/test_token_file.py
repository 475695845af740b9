"""Token files: read at start with the documented precedence, written once (idempotent)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from pdplane.cli import bearer_tokens
from pdplane.cli.drain import DrainSettings
from pdplane.core.token_file import ensure_token, read_token
from pdplane.registry.settings import RegistrySettings


def test_ensure_token_writes_a_private_file_once(tmp_path: Path) -> None:
    path = tmp_path / "token"
    assert ensure_token(path) is True
    first = read_token(path)
    assert len(first) >= 43  # 256 bits, URL-safe base64
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_token(path) is False  # a second run (a restarted init) keeps it
    assert read_token(path) == first
    assert [p.name for p in tmp_path.iterdir()] == ["token"]  # no temporary file left


def test_an_empty_or_missing_file_is_an_error_never_replaced(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    with pytest.raises(ValueError, match="is empty"):
        ensure_token(empty)
    with pytest.raises(ValueError, match="cannot read"):
        read_token(tmp_path / "absent")


def test_registry_reads_both_files_and_an_empty_env_does_not_hide_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token, admin = tmp_path / "token", tmp_path / "admin"
    token.write_text("from-file\n")
    admin.write_text("admin-from-file")
    monkeypatch.setenv("PDPLANE_TOKEN", "")  # an unset compose substitution
    monkeypatch.setenv("PDPLANE_ADMIN_TOKEN_FILE", str(admin))
    # Protected mode holds: 0.0.0.0 is accepted because the file gave a token.
    s = RegistrySettings.parse(["--host", "0.0.0.0", "--token-file", str(token)])
    assert (s.token, s.admin_token) == ("from-file", "admin-from-file")
    # A non-empty flag or variable wins over the file.
    monkeypatch.setenv("PDPLANE_TOKEN", "from-env")
    assert RegistrySettings.parse(["--token-file", str(token)]).token == "from-env"
    assert RegistrySettings.parse(["--token", "flag", "--token-file", str(token)]).token == "flag"


def test_an_unreadable_token_file_stops_the_command_with_its_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        DrainSettings.parse(["d0", "--admin-token-file", str(tmp_path / "nope")])
    assert exc.value.code == 2
    assert "nope" in capsys.readouterr().err


def test_pdplane_tokens_writes_both_files_once_and_never_prints_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--token-file", str(tmp_path / "t"), "--admin-token-file", str(tmp_path / "a")]
    assert bearer_tokens.main(argv) == 0
    first = (read_token(tmp_path / "t"), read_token(tmp_path / "a"))
    assert first[0] != first[1]
    assert bearer_tokens.main(argv) == 0
    assert (read_token(tmp_path / "t"), read_token(tmp_path / "a")) == first
    out = capsys.readouterr().out
    assert "kept the token in" in out and not any(t in out for t in first)
    assert bearer_tokens.main(["--token-file", str(tmp_path / "no" / "dir")]) == 1


def test_generated_tokens_never_start_with_a_dash_and_carry_256_bits() -> None:
    # A token starting with "-" breaks `--token "$T"` (argparse takes it for an option).
    from pdplane.cli.fleet_credentials import generate
    from pdplane.core.token_file import new_token

    tokens = [new_token() for _ in range(2000)]
    creds = [generate("127.0.0.1:1") for _ in range(200)]
    tokens += [c.token for c in creds] + [c.admin_token for c in creds]
    assert not [t for t in tokens if t.startswith("-")]
    assert all(len(bytes.fromhex(t)) == 32 for t in tokens)
    assert len(set(tokens)) == len(tokens)
