"""`pdplane profile` against a served simulator: the fitted profile predicts what it measured."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pdplane.cli.main import main as pdplane_main
from pdplane.plan.profile_cli import GRIDS, error_table, instance_capacity, measure_profile
from pdplane.plan.sweep import Cell
from pdplane.sim.profiles import PROFILES, load_profile
from pdplane.sim.testing import running_sims

CELLS = [Cell(1, 64, 16), Cell(1, 512, 16), Cell(8, 256, 16)]


def test_fit_predicts_the_measured_cells() -> None:
    with running_sims(["both"], profile="tiny-cpu", model="m") as sims:
        url = sims[0].url
        info = instance_capacity(url)
        assert info["model"] == "m"
        fitted, real, _ = measure_profile(url, "m", PROFILES["tiny-cpu"], CELLS, repeats=1)
    _, ttft_err, itl_err = error_table(fitted, real)
    # The served sim's own HTTP time is in the measurements; the fit takes it as request_ms.
    assert ttft_err < 0.25 and itl_err < 0.25
    assert all(r.errors == 0 for r in real)


def test_cli_writes_a_loadable_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    with running_sims(["both"], profile="tiny-cpu", model="m", kv_blocks=300) as sims:
        argv = ["profile", "--url", sims[0].url, "--out", str(out), "--repeats", "1"]
        assert pdplane_main([*argv, "--kv-blocks", "300", "--name", "t"]) == 0
    prof = load_profile(str(out))
    assert prof.name == "t" and prof.num_blocks == 300
    assert "median error" in capsys.readouterr().out
    assert json.loads(out.read_text())["sources"][0].startswith("measured: pdplane profile")


def test_cli_unreachable_instance_exits_1(tmp_path: Path, free_port) -> None:  # type: ignore[no-untyped-def]
    url = f"http://127.0.0.1:{free_port()}"
    assert pdplane_main(["profile", "--url", url, "--out", str(tmp_path / "x.json")]) == 1


@pytest.mark.parametrize("kind", ["no-parent", "a-directory", "read-only-parent"])
def test_cli_unwritable_out_exits_2_before_the_sweep(
    tmp_path: Path,
    free_port,  # type: ignore[no-untyped-def]
    capsys: pytest.CaptureFixture[str],
    kind: str,
) -> None:
    # The URL answers nothing: exit 2 (not 1) shows --out was checked before any request.
    out = {
        "no-parent": tmp_path / "missing" / "p.json",
        "a-directory": tmp_path,
        "read-only-parent": tmp_path / "ro" / "p.json",
    }[kind]
    if kind == "read-only-parent":
        if os.geteuid() == 0:
            pytest.skip("root may write into a read-only directory")
        out.parent.mkdir()
        out.parent.chmod(0o500)
    url = f"http://127.0.0.1:{free_port()}"
    try:
        assert pdplane_main(["profile", "--url", url, "--out", str(out)]) == 2
    finally:
        if kind == "read-only-parent":
            out.parent.chmod(0o700)
    err = capsys.readouterr().err
    assert err.startswith(f"error: pdplane profile: --out {out}: ")
    assert err.count("\n") == 1


def test_cli_write_failure_after_the_sweep_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "p.json"

    def full_disk(self: Path, *args: object, **kwargs: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    monkeypatch.setitem(GRIDS, "cpu", CELLS[:1])  # the sweep only has to finish
    with running_sims(["both"], profile="tiny-cpu", model="m", kv_blocks=300) as sims:
        argv = ["profile", "--url", sims[0].url, "--out", str(out), "--repeats", "1"]
        assert pdplane_main(argv) == 1
    err = capsys.readouterr().err
    assert err == f"pdplane profile: --out {out}: [Errno 28] No space left on device\n"
