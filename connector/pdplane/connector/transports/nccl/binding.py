"""A minimal ctypes binding of the NCCL C API: exactly the calls the KV data path needs.

Why our own binding (see docs/nccl.md): bounded waits need a *non-blocking* communicator
(`ncclConfig_t.blocking = 0`), `ncclCommGetAsyncError` polling and `ncclCommAbort`; vLLM's
`pynccl_wrapper` exposes neither the config struct nor the async-error call, and its surface
changes between the vLLM releases pdplane supports (0.26 .. 0.33). CuPy's binding has blocking
init only. The library itself is the `libnccl.so.2` that the CUDA build of torch already loaded
(or `PDPLANE_NCCL_LIBRARY` / `VLLM_NCCL_SO_PATH`), so the process holds one NCCL.

Nothing is loaded at import: `NcclLibrary.get()` opens the library on first use, so this module
imports on CPU-only machines.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from typing import ClassVar

__all__ = [
    "NCCL_IN_PROGRESS",
    "NCCL_SUCCESS",
    "NCCL_UNIQUE_ID_BYTES",
    "NcclError",
    "NcclLibrary",
    "NcclUnavailableError",
    "nccl_version_code",
]

NCCL_SUCCESS = 0
NCCL_IN_PROGRESS = 7  #: non-blocking communicators: the call continues in the background
NCCL_UNIQUE_ID_BYTES = 128
NCCL_UINT8 = 1  #: ncclDataType_t of raw bytes: the data path moves bytes whatever the dtype

_RESULT_NAMES = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
}

_CONFIG_MAGIC = 0xCAFEBEEF
_CONFIG_UNDEF_INT = -(2**31)


def nccl_version_code(major: int, minor: int, patch: int) -> int:
    """NCCL's NCCL_VERSION(X, Y, Z) encoding (e.g. 2.28.9 -> 22809)."""
    if major <= 2 and minor <= 8:
        return major * 1000 + minor * 100 + patch
    return major * 10000 + minor * 100 + patch


class NcclError(RuntimeError):
    """An NCCL call returned an error. `result` is the ncclResult_t value."""

    def __init__(self, call: str, result: int, detail: str = "") -> None:
        name = _RESULT_NAMES.get(result, f"ncclResult {result}")
        super().__init__(f"{call} failed: {name}" + (f" ({detail})" if detail else ""))
        self.result = result


class NcclUnavailableError(RuntimeError):
    """No libnccl could be loaded (CPU-only machine, or a torch build without NCCL)."""


class UniqueId(ctypes.Structure):
    """ncclUniqueId: 128 opaque bytes, passed by value."""

    _fields_: ClassVar = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


class _Config(ctypes.Structure):
    """ncclConfig_t as of NCCL 2.14. NCCL copies `size` bytes and keeps its defaults for the
    fields a caller's version predates, so this prefix works with every later release."""

    _fields_: ClassVar = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
        ("splitShare", ctypes.c_int),
    ]


_Comm = ctypes.c_void_p
_Stream = ctypes.c_void_p
_Result = ctypes.c_int

_SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "ncclGetVersion": (_Result, [ctypes.POINTER(ctypes.c_int)]),
    "ncclGetUniqueId": (_Result, [ctypes.POINTER(UniqueId)]),
    "ncclCommInitRankConfig": (
        _Result,
        [ctypes.POINTER(_Comm), ctypes.c_int, UniqueId, ctypes.c_int, ctypes.POINTER(_Config)],
    ),
    "ncclCommGetAsyncError": (_Result, [_Comm, ctypes.POINTER(_Result)]),
    "ncclCommAbort": (_Result, [_Comm]),
    "ncclCommFinalize": (_Result, [_Comm]),
    "ncclCommDestroy": (_Result, [_Comm]),
    "ncclGroupStart": (_Result, []),
    "ncclGroupEnd": (_Result, []),
    "ncclSend": (
        _Result,
        [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _Comm, _Stream],
    ),
    "ncclRecv": (
        _Result,
        [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _Comm, _Stream],
    ),
    "ncclGetErrorString": (ctypes.c_char_p, [_Result]),
    "ncclGetLastError": (ctypes.c_char_p, [_Comm]),
}


def _candidates() -> list[str]:
    paths = [os.environ.get("PDPLANE_NCCL_LIBRARY", ""), os.environ.get("VLLM_NCCL_SO_PATH", "")]
    try:
        import nvidia.nccl  # type: ignore[import-not-found]  # the pip wheel torch depends on

        for base in list(getattr(nvidia.nccl, "__path__", [])):
            paths.append(os.path.join(base, "lib", "libnccl.so.2"))
    except ImportError:
        pass
    # A bare soname resolves to the copy torch's CUDA libraries already loaded.
    paths.append("libnccl.so.2")
    return [p for p in paths if p]


class NcclLibrary:
    """The loaded libnccl with typed entry points. One per process: use `NcclLibrary.get()`."""

    _instance: ClassVar[NcclLibrary | None] = None
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, path: str) -> None:
        """Opens `path`. Raises OSError when it cannot be loaded."""
        self.path = path
        self._lib = ctypes.CDLL(path)
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(self._lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        v = ctypes.c_int()
        self.check("ncclGetVersion", self._lib.ncclGetVersion(ctypes.byref(v)))
        self.version_code = int(v.value)

    @classmethod
    def get(cls) -> NcclLibrary:
        """The process' NCCL. Raises NcclUnavailableError when no libnccl can be loaded."""
        with cls._lock:
            if cls._instance is None:
                with contextlib.suppress(ImportError):
                    import torch  # noqa: F401  # loads torch's libnccl first, if it has one
                errors = []
                for path in _candidates():
                    try:
                        cls._instance = cls(path)
                        break
                    except (OSError, AttributeError) as exc:
                        errors.append(f"{path}: {exc}")
                else:
                    raise NcclUnavailableError("cannot load libnccl: " + "; ".join(errors))
            return cls._instance

    @property
    def version(self) -> str:
        """ "major.minor.patch" of the loaded library."""
        code = self.version_code
        if code >= 10000:
            return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
        return f"{code // 1000}.{code // 100 % 10}.{code % 100}"

    def check(self, call: str, result: int, comm: int | None = None) -> int:
        """Returns `result` when it is success or in-progress; raises NcclError otherwise."""
        if result in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            return result
        detail = ""
        if comm is not None:
            raw = self._lib.ncclGetLastError(comm)
            detail = raw.decode(errors="replace") if raw else ""
        raise NcclError(call, result, detail)

    # -- entry points (thin; each returns the ncclResult_t after `check`) ------------------------

    def get_unique_id(self) -> bytes:
        """A fresh ncclUniqueId (128 bytes) naming a communicator to create."""
        uid = UniqueId()
        self.check("ncclGetUniqueId", self._lib.ncclGetUniqueId(ctypes.byref(uid)))
        return bytes(bytearray(uid.internal))

    def comm_init_rank_nonblocking(self, nranks: int, unique_id: bytes, rank: int) -> int:
        """Starts ncclCommInitRankConfig with `blocking = 0` on the current CUDA device.

        Returns the communicator handle at once; poll `comm_async_error` until it is no longer
        NCCL_IN_PROGRESS. Raises ValueError for a malformed id, NcclError on failure."""
        if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"NCCL unique id must be {NCCL_UNIQUE_ID_BYTES} bytes")
        uid = UniqueId()
        ctypes.memmove(uid.internal, unique_id, NCCL_UNIQUE_ID_BYTES)
        cfg = _Config(
            size=ctypes.sizeof(_Config),
            magic=_CONFIG_MAGIC,
            version=nccl_version_code(2, 14, 0),
            blocking=0,
            cgaClusterSize=_CONFIG_UNDEF_INT,
            minCTAs=_CONFIG_UNDEF_INT,
            maxCTAs=_CONFIG_UNDEF_INT,
            netName=None,
            splitShare=_CONFIG_UNDEF_INT,
        )
        comm = _Comm()
        result = self._lib.ncclCommInitRankConfig(
            ctypes.byref(comm), nranks, uid, rank, ctypes.byref(cfg)
        )
        self.check("ncclCommInitRankConfig", result, comm.value)
        if not comm.value:
            raise NcclError("ncclCommInitRankConfig", 3, "no communicator returned")
        return int(comm.value)

    def comm_async_error(self, comm: int) -> int:
        """ncclCommGetAsyncError: NCCL_SUCCESS, NCCL_IN_PROGRESS or an error result (returned,
        not raised, so callers can abort first)."""
        state = _Result()
        self.check("ncclCommGetAsyncError", self._lib.ncclCommGetAsyncError(comm, state))
        return int(state.value)

    def last_error(self, comm: int) -> str:
        """NCCL's last error message for `comm` (may be empty)."""
        raw = self._lib.ncclGetLastError(comm)
        return raw.decode(errors="replace") if raw else ""

    def comm_abort(self, comm: int) -> None:
        """ncclCommAbort: stops in-flight kernels and frees the communicator (never raises)."""
        self._lib.ncclCommAbort(comm)

    def comm_finalize(self, comm: int) -> int:
        """ncclCommFinalize (flushes; non-blocking communicators return NCCL_IN_PROGRESS)."""
        return self.check("ncclCommFinalize", self._lib.ncclCommFinalize(comm), comm)

    def comm_destroy(self, comm: int) -> None:
        """ncclCommDestroy after a finished ncclCommFinalize."""
        self.check("ncclCommDestroy", self._lib.ncclCommDestroy(comm), comm)

    def group_start(self) -> None:
        self.check("ncclGroupStart", self._lib.ncclGroupStart())

    def group_end(self) -> int:
        """ncclGroupEnd; NCCL_IN_PROGRESS for non-blocking communicators (poll async error)."""
        return self.check("ncclGroupEnd", self._lib.ncclGroupEnd())

    def send(self, ptr: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        """ncclSend of `nbytes` raw bytes at device address `ptr` on `stream`."""
        self.check(
            "ncclSend", self._lib.ncclSend(ptr, nbytes, NCCL_UINT8, peer, comm, stream), comm
        )

    def recv(self, ptr: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        """ncclRecv of `nbytes` raw bytes into device address `ptr` on `stream`."""
        self.check(
            "ncclRecv", self._lib.ncclRecv(ptr, nbytes, NCCL_UINT8, peer, comm, stream), comm
        )
