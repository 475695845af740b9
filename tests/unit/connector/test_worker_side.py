"""WorkerSide: a prefill worker and a decode worker in one process, real gRPC on loopback.

Drives them with the metadata the scheduler side would send and asks what vLLM asks every
step (`get_finished`, `get_block_ids_with_load_errors`).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdplane.connector.config import ConnectorConfig
from pdplane.connector.metadata import HoldSpec, LoadSpec, PdPlaneConnectorMetadata, ReleaseSpec
from pdplane.connector.server import start_kv_server
from pdplane.connector.transports.base import ServiceBinding
from pdplane.connector.worker_side import WorkerSide
from pdplane.launch.ports import free_port_run
from pdplane.v1 import instance_pb2, kv_transfer_tcp_pb2_grpc

SHAPE = (16, 2, 4, 16)
LAYOUT = instance_pb2.KvLayout(
    num_layers=2, num_kv_heads=2, head_size=8, block_size=4, dtype="float32"
)


def _worker(name: str, fill: bool, **cfg: object) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    config = ConnectorConfig.model_validate({"pull_timeout_s": 5.0, **cfg})
    side = WorkerSide(config, LAYOUT, instance_id=name, num_blocks=SHAPE[0])
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.randn(SHAPE) if fill else torch.zeros(SHAPE)
        for i in range(2)
    }
    side.register_kv_caches(caches)
    return side, caches


@pytest.fixture
def pair() -> Iterator[tuple[WorkerSide, dict, WorkerSide, dict]]:
    p, pc = _worker("prefill-a", fill=True)
    d, dc = _worker("decode-a", fill=False)
    try:
        yield p, pc, d, dc
    finally:
        p.shutdown()
        d.shutdown()


def _until(fn, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    """Polls fn() (as vLLM's engine steps would) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.005)
    raise AssertionError("timed out")


def _meta(seq: int, **kw: list) -> PdPlaneConnectorMetadata:
    return PdPlaneConnectorMetadata(seq=seq, **kw)


def test_pull_moves_blocks_and_both_sides_report_once(pair) -> None:
    prefill, pc, decode, dc = pair
    endpoint = f"127.0.0.1:{prefill.port}"
    prefill.handle_metadata(_meta(1, holds=[HoldSpec("p-req", "gw.1", (9, 2), 60.0)]))
    decode.handle_metadata(
        _meta(1, loads=[LoadSpec("d-req", "gw.1", endpoint, (0, 1), (3, 11), 8)])
    )
    sending, recving = set(), set()
    deadline = time.monotonic() + 10
    while (not sending or not recving) and time.monotonic() < deadline:
        sending |= prefill.get_finished()[0] or set()
        got = decode.get_finished()[1] or set()
        assert not (got & recving), "reported twice"
        recving |= got
        assert decode.get_block_ids_with_load_errors() == set()
    assert (sending, recving) == ({"p-req"}, {"d-req"})
    for name in pc:
        assert torch.equal(dc[name][3], pc[name][9]) and torch.equal(dc[name][11], pc[name][2])
    time.sleep(0.05)
    assert prefill.get_finished() == (None, None)
    assert decode.get_finished() == (None, None)


def test_failed_pull_reports_finished_and_its_blocks_in_the_same_step(pair) -> None:
    _, _, decode, _ = pair
    dead = f"127.0.0.1:{free_port_run()}"
    decode.handle_metadata(_meta(1, loads=[LoadSpec("d-req", "gw.2", dead, (0, 1), (4, 6), 8)]))
    start = time.monotonic()
    recving = _until(lambda: decode.get_finished()[1])
    assert recving == {"d-req"}
    assert decode.get_block_ids_with_load_errors() == {4, 6}
    assert decode.get_block_ids_with_load_errors() == set()
    assert time.monotonic() - start < 5.0  # well inside the pull timeout
    assert decode.puller.history[-1].ok is False


def test_pull_of_unknown_transfer_fails_cleanly(pair) -> None:
    prefill, _, decode, dc = pair
    endpoint = f"127.0.0.1:{prefill.port}"
    decode.handle_metadata(_meta(1, loads=[LoadSpec("d", "never-issued", endpoint, (0,), (2,), 4)]))
    assert _until(lambda: decode.get_finished()[1]) == {"d"}
    assert decode.get_block_ids_with_load_errors() == {2}
    assert not any(c.any() for c in dc.values())


def test_release_frees_prefill_without_a_pull(pair) -> None:
    prefill, _, decode, _ = pair
    endpoint = f"127.0.0.1:{prefill.port}"
    prefill.handle_metadata(_meta(1, holds=[HoldSpec("p-req", "gw.3", (1,), 60.0)]))
    decode.handle_metadata(_meta(1, releases=[ReleaseSpec("gw.3", endpoint, "not needed")]))
    assert _until(lambda: prefill.get_finished()[0]) == {"p-req"}
    assert prefill.holds.ended["gw.3"] == "aborted: not needed"


def test_same_step_metadata_is_acted_on_once(pair) -> None:
    prefill, _, _, _ = pair
    meta = _meta(5, holds=[HoldSpec("p-req", "gw.4", (1,), 0.05)])
    prefill.handle_metadata(meta)
    prefill.handle_metadata(meta)  # vLLM may bind the same step's metadata twice
    assert _until(lambda: prefill.get_finished()[0]) == {"p-req"}  # hold timed out
    time.sleep(0.1)
    assert prefill.get_finished() == (None, None)


def test_worker_without_kv_caches_fails_loads_instead_of_hanging() -> None:
    config = ConnectorConfig.model_validate({"pull_timeout_s": 2.0})
    side = WorkerSide(config, LAYOUT, instance_id="d")  # register_kv_caches never called
    try:
        side.handle_metadata(_meta(1, loads=[LoadSpec("r", "t", "127.0.0.1:1", (0,), (1,), 4)]))
        assert _until(lambda: side.get_finished()[1]) == {"r"}
        assert side.get_block_ids_with_load_errors() == {1}
    finally:
        side.shutdown()


def test_get_finished_when_idle_costs_the_same_whatever_is_held(pair) -> None:
    # vLLM calls these every engine step: with nothing finished, their cost must not grow with
    # the KV held for transfers. Measured against itself in the same run (best of 3 rounds, to
    # shed a busy host's pauses), not against an absolute time.
    prefill, _, decode, _ = pair

    def per_step_s() -> float:
        n = 2_000
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(n):
                prefill.get_finished()
                decode.get_finished()
                decode.get_block_ids_with_load_errors()
            best = min(best, (time.perf_counter() - start) / n)
        return best

    for i in range(50):
        prefill.holds.add(f"r{i}", f"t{i}", [1], 600)
    few = per_step_s()
    for i in range(50, 5_000):
        prefill.holds.add(f"r{i}", f"t{i}", [1], 600)
    many = per_step_s()
    # 100x the holds; a scan of them would cost ~100x.
    assert many < 4 * few, (many * 1e6, few * 1e6)


def _self_signed(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
            "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_pull_over_tls_with_token(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    secure = {"token": "t0k", "tls_cert": str(cert), "tls_key": str(key), "tls_ca": str(cert)}
    prefill, pc = _worker("prefill-tls", fill=True, **secure)
    decode, dc = _worker("decode-tls", fill=False, **secure)
    plain, _ = _worker("decode-plain", fill=False, token="t0k")  # no TLS: refused
    try:
        endpoint = f"127.0.0.1:{prefill.port}"
        prefill.handle_metadata(_meta(1, holds=[HoldSpec("p", "gw.tls", (4,), 60.0)]))
        plain.handle_metadata(_meta(1, loads=[LoadSpec("x", "gw.tls", endpoint, (0,), (1,), 4)]))
        assert _until(lambda: plain.get_finished()[1]) == {"x"}
        assert plain.get_block_ids_with_load_errors() == {1}
        decode.handle_metadata(_meta(1, loads=[LoadSpec("d", "gw.tls", endpoint, (0,), (2,), 4)]))
        assert _until(lambda: decode.get_finished()[1]) == {"d"}
        assert decode.get_block_ids_with_load_errors() == set()
        assert all(torch.equal(dc[n][2], pc[n][4]) for n in pc)
    finally:
        for side in (prefill, decode, plain):
            side.shutdown()


class _SilentPrefill(kv_transfer_tcp_pb2_grpc.TcpKvTransferServicer):
    """Accepts PullBlocks and never sends a byte (a hung prefill)."""

    def PullBlocks(self, request, context):  # type: ignore[no-untyped-def]
        while context.is_active():
            time.sleep(0.02)
        yield from ()


def test_pull_from_a_hung_prefill_ends_at_the_pull_timeout() -> None:
    silent = ServiceBinding(
        "pdplane.v1.TcpKvTransfer",
        lambda s: kv_transfer_tcp_pb2_grpc.add_TcpKvTransferServicer_to_server(_SilentPrefill(), s),
    )
    server = start_kv_server([silent], "127.0.0.1:0")
    port = server.port
    decode, _ = _worker("decode-h", fill=False, pull_timeout_s=1.0)
    try:
        start = time.monotonic()
        decode.handle_metadata(
            _meta(1, loads=[LoadSpec("d", "gw.h", f"127.0.0.1:{port}", (0,), (3,), 4)])
        )
        assert _until(lambda: decode.get_finished()[1], timeout=10) == {"d"}
        took = time.monotonic() - start
        assert decode.get_block_ids_with_load_errors() == {3}
        assert 0.9 <= took < 3.0, took
        assert "DEADLINE_EXCEEDED" in decode.puller.history[-1].error
    finally:
        decode.shutdown()
        server.stop(0)
