"""Bad profile files: `load_profile` names the file and what is wrong; `pdplane plan` prints it
as one line and exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdplane.cli.main import main as pdplane_main
from pdplane.sim.profiles import PROFILES, load_profile

GOOD = PROFILES["tiny-cpu"].to_dict()


def _plan_error(profile: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert pdplane_main(["plan", "--profile", profile]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("error: pdplane plan: profile ")
    return err


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"[]", "must be a JSON object, not a list"),
        (b"{}", "missing key 'cost'"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "cost"}).encode(), "missing key 'cost'"),
        (json.dumps({**GOOD, "cost": "x"}).encode(), "'cost' must be an object, not a string"),
        (json.dumps({**GOOD, "cost": {"stp_ms": 1}}).encode(), "unknown cost fields: stp_ms"),
        (json.dumps({**GOOD, "sources": "x"}).encode(), "'sources' must be a list of strings"),
        (b"\xff\xfe\x00\x01binary", "not UTF-8 JSON"),
        (b"{not json", "not JSON"),
    ],
)
def test_a_malformed_file_names_itself_and_the_fault(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, says: str
) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(content)
    with pytest.raises(ValueError) as exc:
        load_profile(str(path))
    assert str(exc.value).startswith(f"profile {path}: {says}"), exc.value
    assert says in _plan_error(str(path), capsys)


def test_a_missing_file_or_a_directory_is_said_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "x.json"
    with pytest.raises(ValueError, match=f"^profile file {missing} does not exist$"):
        load_profile(str(missing))
    with pytest.raises(ValueError, match=f"^profile file {tmp_path} is a directory$"):
        load_profile(str(tmp_path))
    assert "does not exist" in _plan_error(str(missing), capsys)
    # a bare word is a profile name: the known ones are listed
    with pytest.raises(ValueError, match="unknown profile 'no-such'; known: zero, tiny-cpu"):
        load_profile("no-such")


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"cost": {**GOOD["cost"], "step_ms": -5}}, "cost.step_ms must be a finite number >= 0"),
        ({"cost": {**GOOD["cost"], "seq_ms": "1"}}, "cost.seq_ms must be a finite number >= 0"),
        ({"cost": {**GOOD["cost"], "token_ms": 1e999}}, "cost.token_ms must be a finite"),
        ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1 (got 0)"),
        ({"num_blocks": 2.5}, "num_blocks must be an integer >= 1 (got 2.5)"),
        ({"block_size": True}, "block_size must be an integer >= 1 (got True)"),
        ({"max_model_len": 64}, "max_model_len (64) must be >= block_size (128)"),
        ({"transfer_gbps": -1.0}, "transfer_gbps must be a finite number >= 0 (got -1.0)"),
        ({"push_buffer_bytes": 0}, "push_buffer_bytes must be an integer >= 1 (got 0)"),
        ({"kv_dtype": 4}, "kv_dtype must be a string"),
        ({"name": None}, "name must be a string"),
    ],
)
def test_nonsense_values_are_refused_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, object], says: str
) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**GOOD, **change}))
    with pytest.raises(ValueError) as exc:
        load_profile(str(path))
    assert str(exc.value).startswith(f"profile {path}: {says}"), exc.value
    assert says in _plan_error(str(path), capsys)


def test_every_named_profile_passes_the_checks(tmp_path: Path) -> None:
    for name, profile in PROFILES.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(profile.to_dict()))
        assert load_profile(str(path)) == profile
