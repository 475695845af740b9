"""Decode's pull returns once its receives completed; prefill's answer is read afterwards
(`NcclEngine._settle`). An answer that reports a failure of prefill's side drops decode's
communicator too; a good answer keeps it. CPU only: fake communicator, fake call."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

torch = pytest.importorskip("torch")

from pdplane.connector.nccl.engine import NcclEngine  # noqa: E402
from pdplane.v1 import kv_transfer_pb2  # noqa: E402


class FakeComm:
    usable = True

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, reason: str) -> None:
        self.aborted.append(reason)
        self.usable = False


class FakeRpcError(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return "prefill's wait timed out"


class FakeCall:
    def __init__(self, answer: Any) -> None:
        self._answer = answer

    def result(self) -> kv_transfer_pb2.SendBlocksNcclResponse:
        if isinstance(self._answer, Exception):
            raise self._answer
        return self._answer  # type: ignore[no-any-return]


@pytest.fixture
def engine() -> Iterator[NcclEngine]:
    views = [torch.zeros(2, 8, 64, dtype=torch.uint8)]  # [K/V, blocks, bytes per block half]
    eng = NcclEngine(0, views, lib=object())  # type: ignore[arg-type]
    yield eng
    eng._answers.shutdown(wait=True)


def _settle(engine: NcclEngine, answer: Any, nbytes: int = 256) -> FakeComm:
    comm = FakeComm()
    engine._comms["prefill-a#0"] = comm  # type: ignore[assignment]
    engine._settle("prefill-a", "prefill-a#0", comm, FakeCall(answer), nbytes)  # type: ignore[arg-type]
    return comm


def test_a_good_answer_keeps_the_communicator(engine: NcclEngine) -> None:
    comm = _settle(engine, kv_transfer_pb2.SendBlocksNcclResponse(bytes_sent=256))
    assert comm.aborted == []
    assert engine._comms["prefill-a#0"] is comm


def test_a_failed_answer_drops_the_communicator(engine: NcclEngine) -> None:
    comm = _settle(engine, FakeRpcError())
    assert comm.aborted and "DEADLINE_EXCEEDED" in comm.aborted[0]
    assert "prefill-a#0" not in engine._comms
    assert [key for key, _ in engine.retired] == ["prefill-a#0"]


def test_a_byte_count_mismatch_drops_the_communicator(engine: NcclEngine) -> None:
    comm = _settle(engine, kv_transfer_pb2.SendBlocksNcclResponse(bytes_sent=128))
    assert comm.aborted and "128" in comm.aborted[0]
    assert "prefill-a#0" not in engine._comms
