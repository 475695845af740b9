"""Push mode's receive-buffer accounting (CPU only: no receive is posted here)."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from pdplane.connector.transports.nccl.engine import NcclTransferError
from pdplane.connector.transports.nccl.push import PushReceiver
from pdplane.v1 import kv_transfer_nccl_pb2

BLOCK = 1000  # bytes per block, all layers


def _receiver(gpu_bytes: int, host_bytes: int) -> PushReceiver:
    mover = SimpleNamespace(transfer_bytes=lambda n: n * BLOCK)
    return PushReceiver(SimpleNamespace(mover=mover), gpu_bytes, host_bytes)  # type: ignore[arg-type]


def _items(*sizes: int, prefix: str = "t") -> list[kv_transfer_nccl_pb2.NcclPushItem]:
    return [
        kv_transfer_nccl_pb2.NcclPushItem(transfer_id=f"{prefix}{i}", num_blocks=n)
        for i, n in enumerate(sizes)
    ]


def test_gpu_buffer_first_then_host_spill() -> None:
    r = _receiver(gpu_bytes=5 * BLOCK, host_bytes=4 * BLOCK)
    try:
        plan = r._reserve(_items(3, 3, 1))
        assert [spilled for _, _, spilled in plan] == [False, True, False]
        assert r.headroom_bytes == 1 * BLOCK
    finally:
        r.close()


def test_all_or_nothing_when_both_are_full() -> None:
    r = _receiver(gpu_bytes=2 * BLOCK, host_bytes=2 * BLOCK)
    try:
        with pytest.raises(NcclTransferError) as err:
            r._reserve(_items(2, 2, 1))
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "fit neither" in str(err.value)
        # Nothing was kept from the refused request: the whole budget is still free.
        assert r.headroom_bytes == 2 * BLOCK
        assert [s for _, _, s in r._reserve(_items(2, 2, prefix="u"))] == [False, True]
    finally:
        r.close()


def test_an_empty_transfer_id_is_refused() -> None:
    r = _receiver(gpu_bytes=10 * BLOCK, host_bytes=0)
    try:
        with pytest.raises(NcclTransferError) as err:
            r._reserve([kv_transfer_nccl_pb2.NcclPushItem(transfer_id="", num_blocks=1)])
        assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
    finally:
        r.close()
