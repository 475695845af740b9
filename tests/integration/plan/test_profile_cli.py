"""`pdplane profile` against a served simulator (the fitted profile predicts what it measured)
and against a fake instance on loopback (its failures reach the user as one line)."""

from __future__ import annotations

import http.server
import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdplane.cli.main import main as pdplane_main
from pdplane.launch.ports import free_port_run
from pdplane.plan.profile_cli import GRIDS, error_table, instance_capacity, measure_profile
from pdplane.plan.sweep import Cell
from pdplane.sim.profiles import PROFILES, load_profile
from pdplane.sim.testing import running_sims
from tests.loopback_http import serving

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


def test_cli_unreachable_instance_exits_1(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port_run()}"
    assert pdplane_main(["profile", "--url", url, "--out", str(tmp_path / "x.json")]) == 1


@pytest.mark.parametrize("kind", ["no-parent", "a-directory", "read-only-parent"])
def test_cli_unwritable_out_exits_2_before_the_sweep(
    tmp_path: Path,
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
    url = f"http://127.0.0.1:{free_port_run()}"
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


def test_cli_unknown_model_exits_2_naming_the_served_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with running_sims(["both"], profile="tiny-cpu", model="m") as sims:
        url = sims[0].url
        argv = ["profile", "--url", url, "--out", str(tmp_path / "p.json"), "--model", "nope"]
        assert pdplane_main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"error: pdplane profile: --model nope: {url} serves m\n"


def test_no_answer_keeps_the_instance_s_first_error() -> None:
    # The model check is the CLI's; here the sweep itself meets vLLM's 404.
    with (
        running_sims(["both"], profile="tiny-cpu", model="m") as sims,
        pytest.raises(RuntimeError) as exc,
    ):
        measure_profile(sims[0].url, "nope", PROFILES["tiny-cpu"], CELLS[:1], repeats=1)
    assert str(exc.value) == (
        "no answer in cells B1-L64-O16 (first error: HTTP 404: The model `nope` does not exist.)"
    )


class _FlakyInstance(http.server.BaseHTTPRequestHandler):
    """An OpenAI completions server whose every 4th request fails with a 500 (the first with a
    long message: the error kept is bounded)."""

    protocol_version = "HTTP/1.0"  # the stream ends when the connection closes
    counter = itertools.count()

    def do_GET(self) -> None:
        bodies = {"/v1/models": b'{"data": [{"id": "m", "max_model_len": 1024}]}', "/metrics": b""}
        body = bodies.get(self.path, b'{"detail": "Not Found"}')
        self.send_response(200 if self.path in bodies else 404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        if next(self.counter) % 4 == 3:
            body = json.dumps({"error": {"message": "boom " * 200, "code": 500}}).encode()
            self.send_response(500)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for i in range(4):
            event = {"choices": [{"text": "x", "token_ids": [i + 11]}]}
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def flaky_url() -> Iterator[str]:
    _FlakyInstance.counter = itertools.count()
    with serving(_FlakyInstance) as url:
        yield url


def test_cli_warns_of_a_cell_fitted_on_fewer_requests(
    tmp_path: Path,
    flaky_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(GRIDS, "cpu", [Cell(4, 64, 4)])
    argv = ["profile", "--url", flaky_url, "--out", str(tmp_path / "p.json"), "--repeats", "1"]
    assert pdplane_main(argv) == 0
    warning = capsys.readouterr().err
    assert warning.startswith(
        "warning: pdplane profile: cell B4-L64-O4: 1 of 4 requests failed, fitted on 3 "
        "(first error: HTTP 500: boom boom"
    )
    assert warning.count("\n") == 1 and len(warning) < 300


def test_cli_http_error_is_one_line(
    tmp_path: Path, flaky_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"{flaky_url}/no-such-prefix"  # /v1/models answers 200 only at the root
    assert pdplane_main(["profile", "--url", url, "--out", str(tmp_path / "p.json")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mozilla" not in err
    assert err.startswith(f"pdplane profile: {url}: ")
