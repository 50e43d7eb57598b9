"""Loading libcomm.so through ctypes, and turning its result codes into exceptions.

The library is opened with RTLD_LOCAL: PyTorch's CUDA build loads NVIDIA's libnccl into the
global namespace, and libcomm exports the same ``nccl*`` names. Keeping libcomm local means
neither library's symbols can capture the other's calls (see DESIGN.md, "Symbols").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Iterator

c_int = ctypes.c_int
c_size_t = ctypes.c_size_t
c_void_p = ctypes.c_void_p
c_char_p = ctypes.c_char_p

# ncclResult_t
SUCCESS = 0
IN_PROGRESS = 7
RESULT_NAMES = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
    8: "ncclTimeout",
}

# ncclRedOp_t, plus comm's bitwise extensions (include/nccl.h).
OP_SUM, OP_PROD, OP_MAX, OP_MIN, OP_AVG = 0, 1, 2, 3, 4
OP_BAND, OP_BOR, OP_BXOR = 2147418113, 2147418114, 2147418115

# ncclDataType_t
INT8, UINT8, INT32, UINT32, INT64, UINT64 = 0, 1, 2, 3, 4, 5
FLOAT16, FLOAT32, FLOAT64, BFLOAT16, FLOAT8E4M3, FLOAT8E5M2 = 6, 7, 8, 9, 10, 11

SPLIT_NOCOLOR = -1
SCALAR_DEVICE = 0
SCALAR_HOST_IMMEDIATE = 1

FEATURE_DEVICE_MEMORY = 0x1
FEATURE_WINDOWS = 0x2

UNIQUE_ID_BYTES = 128
_CONFIG_UNDEF_INT = -(2**31)
_API_MAGIC = 0xCAFEBEEF
_VERSION_CODE = 23007


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


class Config(ctypes.Structure):
    """ncclConfig_t at API level 2.30 (include/nccl.h)."""

    _fields_ = [
        ("size", c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", c_int),
        ("cgaClusterSize", c_int),
        ("minCTAs", c_int),
        ("maxCTAs", c_int),
        ("netName", c_char_p),
        ("splitShare", c_int),
        ("trafficClass", c_int),
        ("commName", c_char_p),
        ("collnetEnable", c_int),
        ("CTAPolicy", c_int),
        ("shrinkShare", c_int),
        ("nvlsCTAs", c_int),
        ("nChannelsPerNetPeer", c_int),
        ("nvlinkCentricSched", c_int),
        ("graphUsageMode", c_int),
        ("numRmaCtx", c_int),
        ("maxP2pPeers", c_int),
        ("graphStreamOrdering", c_int),
    ]

    @classmethod
    def new(cls, comm_name: str | None = None) -> Config:
        # The equivalent of NCCL_CONFIG_INITIALIZER: every field undefined but the header.
        cfg = cls()
        for name, ctype in cls._fields_:
            if ctype is c_int:
                setattr(cfg, name, _CONFIG_UNDEF_INT)
        cfg.size = ctypes.sizeof(cls)
        cfg.magic = _API_MAGIC
        cfg.version = _VERSION_CODE
        if comm_name:
            cfg.commName = comm_name.encode()
        return cfg


try:  # torch.distributed's own error type, when this torch has one.
    from torch.distributed import DistBackendError as _ErrorBase
except Exception:  # noqa: BLE001  # pragma: no cover - older torch, or torch without distributed
    _ErrorBase = RuntimeError


class CommError(_ErrorBase):
    """A libcomm call failed. ``result`` is the ncclResult_t; the message is the library's own.

    A subclass of RuntimeError, and of torch.distributed.DistBackendError where torch has it.
    """

    def __init__(self, message: str, result: int | None = None, call: str | None = None) -> None:
        super().__init__(message)
        self.result = result
        self.call = call

    @property
    def result_name(self) -> str:
        return RESULT_NAMES.get(self.result, str(self.result))


_PROTOTYPES = {
    # name: (restype, argtypes)
    "ncclGetVersion": (c_int, [ctypes.POINTER(c_int)]),
    "commGetFeatures": (c_int, [ctypes.POINTER(c_int)]),
    "ncclGetUniqueId": (c_int, [ctypes.POINTER(UniqueId)]),
    "ncclCommInitRankConfig": (
        c_int,
        [ctypes.POINTER(c_void_p), c_int, UniqueId, c_int, ctypes.POINTER(Config)],
    ),
    "ncclCommSplit": (c_int, [c_void_p, c_int, c_int, ctypes.POINTER(c_void_p), ctypes.POINTER(Config)]),
    "ncclCommFinalize": (c_int, [c_void_p]),
    "ncclCommDestroy": (c_int, [c_void_p]),
    "ncclCommAbort": (c_int, [c_void_p]),
    "ncclCommCount": (c_int, [c_void_p, ctypes.POINTER(c_int)]),
    "ncclCommUserRank": (c_int, [c_void_p, ctypes.POINTER(c_int)]),
    "ncclCommGetAsyncError": (c_int, [c_void_p, ctypes.POINTER(c_int)]),
    "ncclGetErrorString": (c_char_p, [c_int]),
    "ncclGetLastError": (c_char_p, [c_void_p]),
    "ncclGroupStart": (c_int, []),
    "ncclGroupEnd": (c_int, []),
    "ncclAllReduce": (c_int, [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]),
    "ncclBroadcast": (c_int, [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]),
    "ncclReduce": (c_int, [c_void_p, c_void_p, c_size_t, c_int, c_int, c_int, c_void_p, c_void_p]),
    "ncclAllGather": (c_int, [c_void_p, c_void_p, c_size_t, c_int, c_void_p, c_void_p]),
    "ncclReduceScatter": (c_int, [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]),
    "ncclAlltoAll": (c_int, [c_void_p, c_void_p, c_size_t, c_int, c_void_p, c_void_p]),
    "commAlltoAllv": (
        c_int,
        [
            c_void_p,
            ctypes.POINTER(c_size_t),
            ctypes.POINTER(c_size_t),
            c_void_p,
            ctypes.POINTER(c_size_t),
            ctypes.POINTER(c_size_t),
            c_int,
            c_void_p,
            c_void_p,
        ],
    ),
    "ncclGather": (c_int, [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]),
    "ncclScatter": (c_int, [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]),
    "ncclSend": (c_int, [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]),
    "ncclRecv": (c_int, [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]),
    "commRecvAny": (c_int, [c_void_p, c_size_t, c_int, ctypes.POINTER(c_int), c_void_p, c_void_p]),
    "ncclRedOpCreatePreMulSum": (c_int, [ctypes.POINTER(c_int), c_void_p, c_int, c_int, c_void_p]),
    "ncclRedOpDestroy": (c_int, [c_int, c_void_p]),
}

c_uint64 = ctypes.c_uint64
_P = ctypes.POINTER


class WaitSignalDesc(ctypes.Structure):
    """ncclWaitSignalDesc_t."""

    _fields_ = [("opCnt", c_int), ("peer", c_int), ("sigIdx", c_int), ("ctx", c_int)]


# Windows and one-sided operations (include/nccl.h); looked up lazily, so a libcomm without
# them still loads for the collectives.
_WINDOW_PROTOTYPES = {
    "commMemAllocShared": (c_int, [_P(c_void_p), c_size_t]),
    "commMemFreeShared": (c_int, [c_void_p]),
    "ncclCommWindowRegister": (c_int, [c_void_p, c_void_p, c_size_t, _P(c_void_p), c_int]),
    "commWindowAllocate": (c_int, [c_void_p, c_size_t, c_int, _P(c_void_p), _P(c_void_p)]),
    "ncclCommWindowDeregister": (c_int, [c_void_p, c_void_p]),
    "ncclWinGetUserPtr": (c_int, [c_void_p, c_void_p, _P(c_void_p)]),
    "ncclPutSignal": (
        c_int,
        [c_void_p, c_size_t, c_int, c_int, c_void_p, c_size_t, c_int, c_int, ctypes.c_uint, c_void_p, c_void_p],
    ),
    "ncclSignal": (c_int, [c_int, c_int, c_int, ctypes.c_uint, c_void_p, c_void_p]),
    "ncclWaitSignal": (c_int, [c_int, _P(WaitSignalDesc), c_void_p, c_void_p]),
    "commWinPut": (c_int, [c_void_p, c_size_t, c_int, c_int, c_void_p, c_size_t, c_void_p]),
    "commWinGet": (c_int, [c_void_p, c_size_t, c_int, c_int, c_void_p, c_size_t, c_void_p]),
    "commWinFetchAdd": (c_int, [c_uint64, _P(c_uint64), c_int, c_int, c_void_p, c_size_t, c_void_p]),
    "commWinCompareSwap": (c_int, [c_uint64, c_uint64, _P(c_uint64), c_int, c_int, c_void_p, c_size_t, c_void_p]),
    "commWinFlush": (c_int, [c_int, c_void_p, c_void_p]),
    "commWinPeerPtr": (c_int, [c_void_p, c_void_p, c_int, _P(c_void_p)]),
    "commSetTimeout": (c_int, [c_void_p, ctypes.c_double]),
    "commSetBlocking": (c_int, [c_void_p, c_int]),
    "commWinPeerSize": (c_int, [c_void_p, c_void_p, c_int, _P(c_size_t)]),
    "commWinSignalPads": (c_int, [c_void_p, c_void_p, c_int, _P(c_void_p), _P(c_int)]),
    "commWinChannelSignal": (c_int, [c_int, c_int, c_uint64, c_void_p, c_void_p]),
    "commWinChannelWait": (c_int, [c_int, c_int, c_uint64, c_void_p, c_void_p]),
    "commWinChannelBarrier": (c_int, [c_int, c_uint64, c_void_p, c_void_p]),
}

WIN_COLL_SYMMETRIC = 0x01
RESULT_TIMEOUT = 8


class Library:
    """The opened libcomm.so with typed entry points as attributes (``lib.ncclAllReduce``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._dll = ctypes.CDLL(path, mode=os.RTLD_LOCAL)
        for name, (restype, argtypes) in _PROTOTYPES.items():
            fn = getattr(self._dll, name)
            fn.restype = restype
            fn.argtypes = argtypes
            setattr(self, name, fn)

    def __getattr__(self, name: str):
        # The window entry points, bound on first use (see _WINDOW_PROTOTYPES).
        proto = None if name.startswith("_") else _WINDOW_PROTOTYPES.get(name)
        if proto is None:
            raise AttributeError(name)
        try:
            fn = getattr(self._dll, name)
        except AttributeError as err:
            raise CommError(
                f"comm: {self.path} has no {name}; windows need a libcomm with windows (issue 12)", call=name
            ) from err
        fn.restype, fn.argtypes = proto
        setattr(self, name, fn)
        return fn

    def last_error(self, comm: ctypes.c_void_p | int | None = None) -> str:
        """The library's message for the last failed call on this thread (and communicator)."""
        msg = self.ncclGetLastError(comm)
        return msg.decode(errors="replace") if msg else ""

    def check(self, result: int, call: str, comm: ctypes.c_void_p | int | None = None) -> None:
        """Raises CommError for a non-success result, with ncclGetLastError's text."""
        if result == SUCCESS:
            return
        detail = self.last_error(comm)
        if not detail and comm is not None:
            detail = self.last_error(None)
        name = RESULT_NAMES.get(result, f"result {result}")
        if not detail:
            raw = self.ncclGetErrorString(result)
            detail = raw.decode(errors="replace") if raw else "no message"
        raise CommError(f"comm: {call} failed ({name}): {detail}", result=result, call=call)

    def version(self) -> int:
        v = c_int()
        self.check(self.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        return v.value

    def features(self) -> int:
        f = c_int()
        self.check(self.commGetFeatures(ctypes.byref(f)), "commGetFeatures")
        return f.value


def _candidates() -> Iterator[tuple[str, str]]:
    """Where libcomm.so is looked for, in order: COMM_LIBRARY, next to this package, the
    dynamic loader's search path (LD_LIBRARY_PATH, ld.so.cache, system directories)."""
    env = os.environ.get("COMM_LIBRARY")
    if env:
        yield env, "COMM_LIBRARY"
        return
    here = os.path.dirname(os.path.abspath(__file__))
    # lib/libcomm.abi3.so is the wheel's (python/setup.py names it as setuptools-rust does).
    for name in ("libcomm.so", os.path.join("lib", "libcomm.so"), os.path.join("lib", "libcomm.abi3.so")):
        path = os.path.join(here, name)
        if os.path.exists(path):
            yield path, "next to the package"
    yield "libcomm.so", "the library search path"
    found = ctypes.util.find_library("comm")
    if found and found != "libcomm.so":
        yield found, "the library search path"


_lock = threading.Lock()
_library: Library | None = None


def load_library() -> Library:
    """Opens libcomm.so once per process and returns the Library."""
    global _library
    with _lock:
        if _library is not None:
            return _library
        tried = []
        for path, where in _candidates():
            try:
                _library = Library(path)
                return _library
            except OSError as err:
                tried.append(f"{path} ({where}): {err}")
            except AttributeError as err:
                raise ImportError(f"comm_torch: {path} is not a libcomm this package can use: {err}") from err
        raise ImportError(
            "comm_torch: cannot load libcomm.so. Set COMM_LIBRARY to its path, put it next to "
            "the comm_torch package, or on LD_LIBRARY_PATH. Tried: " + "; ".join(tried)
        )


def library_path() -> str:
    return load_library().path


def features() -> int:
    return load_library().features()


def version() -> int:
    return load_library().version()
