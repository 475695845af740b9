"""The NCCL transport's error: what failed, and the gRPC status that fits it best."""

from __future__ import annotations

import grpc

__all__ = ["NcclTransferError", "code_of", "status_of"]


class NcclTransferError(RuntimeError):
    """A transfer or handshake failed; `code` is the gRPC status that fits it best."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INTERNAL) -> None:
        super().__init__(message)
        self.code = code


def code_of(status: grpc.StatusCode) -> int:
    """The numeric code of a gRPC status (as the control stream's messages carry it)."""
    return int(status.value[0])


def status_of(code: int) -> grpc.StatusCode:
    """The gRPC status with numeric `code` (UNKNOWN for a number gRPC does not define)."""
    return next((s for s in grpc.StatusCode if s.value[0] == code), grpc.StatusCode.UNKNOWN)
