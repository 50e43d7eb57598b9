"""Shared host memory and windows over libcomm, the common ground of ``symm_mem``,
``allocate_symmetric_memory``, ``rdma`` and the torchcomms backend's windows.

Memory comes from ``commMemAllocShared`` (a memfd that the ranks of a host map once it is in
a window), and becomes a tensor through a ctypes array that torch.frombuffer keeps alive: the
memory is freed when the last tensor over it is gone, or explicitly. Windows are registered
collectively with ``ncclCommWindowRegister``, in issue order with the communicator's other
operations (the engine's executor). One-sided calls run on the caller's thread: they do not
involve the target, so two threads may wait on different channels at once.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from . import _lib
from ._core import Engine
from ._lib import CommError

_byref = ctypes.byref

# The signal pad size symm_mem.set_signal_pad_size chose (bytes), and the communicators that
# have made their first window (the library fixes a communicator's channel count then).
_pad_bytes: int | None = None
_engines_with_windows: weakref.WeakSet = weakref.WeakSet()
_CHANNEL_VARS = ("COMM_WIN_CHANNELS", "NCCL_WIN_CHANNELS")


def pad_bytes() -> int | None:
    return _pad_bytes


def set_pad_bytes(nbytes: int) -> None:
    global _pad_bytes
    _pad_bytes = nbytes


def windows_made() -> bool:
    """Whether this process has registered a window on any communicator."""
    return len(_engines_with_windows) > 0


def default_channels() -> int:
    """The library's channel count per window when no signal pad size was set."""
    for name in _CHANNEL_VARS:
        value = os.environ.get(name, "").strip()
        if value:
            try:
                return min(max(int(value), 1), 4096)
            except ValueError:
                pass
    return 32


def _register_with_pad_size(engine: Engine, register: Any) -> Any:
    """Runs ``register``; when a signal pad size was set and this is the communicator's first
    window, the library is told the channel count it implies (COMM_WIN_CHANNELS, which it
    reads once per communicator, on rank 0)."""
    first = engine not in _engines_with_windows
    _engines_with_windows.add(engine)
    if _pad_bytes is None or not first:
        return register()
    saved = os.environ.get(_CHANNEL_VARS[0])
    os.environ[_CHANNEL_VARS[0]] = str(min(max(_pad_bytes // (4 * engine.size), 1), 4096))
    try:
        return register()
    finally:
        if saved is None:
            del os.environ[_CHANNEL_VARS[0]]
        else:
            os.environ[_CHANNEL_VARS[0]] = saved


def engine_of(group: Any = None) -> Engine:
    """The comm communicator behind ``group`` (a ProcessGroup, its name, or None for the
    default group). ValueError when the group is not on backend comm."""
    if group is None:
        if not dist.is_initialized():
            raise ValueError("comm_torch: no group given and torch.distributed is not initialized")
        group = dist.distributed_c10d._get_default_group()
    elif isinstance(group, str):
        group = dist.distributed_c10d._resolve_process_group(group)
    getters = (
        lambda g: g._comm_backend.engine,
        lambda g: g.engine,
        lambda g: g._get_backend(torch.device("cpu")).engine,
    )
    for get in getters:
        try:
            engine = get(group)
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(engine, Engine):
            return engine
    raise ValueError(f"comm_torch: group {group!r} does not run on backend 'comm'; symmetric memory needs it")


def _frombuffer(arr: Any, nbytes: int) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer(arr, dtype=torch.uint8)[:nbytes]


def bytes_tensor(ptr: int, nbytes: int, keep: Any = None) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` at address ``ptr``; ``keep`` stays alive as long as it."""
    arr = (ctypes.c_ubyte * max(nbytes, 1)).from_address(ptr)
    arr._comm_keep = keep
    return _frombuffer(arr, nbytes)


def typed_view(raw: torch.Tensor, sizes: Any, dtype: torch.dtype, offset_bytes: int = 0) -> torch.Tensor:
    """``raw`` (uint8) from ``offset_bytes`` on, seen as ``dtype`` with shape ``sizes``."""
    shape = torch.Size(sizes)
    elem = torch.empty((), dtype=dtype).element_size()
    need = shape.numel() * elem
    if offset_bytes < 0 or offset_bytes + need > raw.numel():
        raise ValueError(
            f"comm_torch: {need} bytes at byte offset {offset_bytes} do not fit in a buffer of {raw.numel()} bytes"
        )
    if offset_bytes % elem:
        raise ValueError(f"comm_torch: byte offset {offset_bytes} is not a multiple of {dtype}'s size {elem}")
    return raw[offset_bytes : offset_bytes + need].view(dtype).view(shape)


class Allocation:
    """One ``commMemAllocShared`` block; windows over it are deregistered before it is freed."""

    _by_ptr: ClassVar[dict[int, weakref.ref]] = {}
    _lock = threading.Lock()

    def __init__(self, nbytes: int) -> None:
        self.lib = _lib.load_library()
        self.nbytes = nbytes
        ptr = ctypes.c_void_p()
        self.lib.check(self.lib.commMemAllocShared(_byref(ptr), max(nbytes, 1)), "commMemAllocShared")
        self.ptr = ptr.value
        self.windows: dict[int, Window] = {}  # by id of the engine
        self.handles: dict[Any, Any] = {}  # symm_mem handles, by engine and offset
        self.freed = False
        arr = (ctypes.c_ubyte * max(nbytes, 1)).from_address(self.ptr)
        arr._comm_keep = self  # the allocation lives as long as a tensor over it
        # Freed with the last tensor over it (the ctypes array torch.frombuffer holds).
        self._finalizer = weakref.finalize(arr, Allocation._release, self.lib, self.ptr, self.windows)
        self._raw = weakref.ref(arr)
        with Allocation._lock:
            Allocation._by_ptr[self.ptr] = weakref.ref(self)
        self._first: torch.Tensor | None = _frombuffer(arr, nbytes)  # until create() hands it out

    @classmethod
    def create(cls, nbytes: int) -> tuple[Allocation, torch.Tensor]:
        """A new allocation and a uint8 tensor over it (which keeps it alive)."""
        alloc = cls(nbytes)
        raw, alloc._first = alloc._first, None
        return alloc, raw

    def tensor(self) -> torch.Tensor:
        """A new uint8 tensor over the whole allocation."""
        arr = self._raw()
        if arr is None or self.freed:
            raise CommError("comm: the symmetric memory was freed", call="tensor")
        return _frombuffer(arr, self.nbytes)

    @staticmethod
    def _release(lib, ptr, windows):
        for win in list(windows.values()):
            win.deregister()
        windows.clear()
        with Allocation._lock:
            Allocation._by_ptr.pop(ptr, None)
        lib.commMemFreeShared(ptr)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Allocation | None:
        """The allocation whose memory ``tensor`` lies in, if any."""
        base = tensor.untyped_storage().data_ptr()
        with cls._lock:
            ref = cls._by_ptr.get(base)
        alloc = ref() if ref is not None else None
        return alloc if alloc is not None and not alloc.freed else None

    def window(self, engine: Engine) -> Window:
        """The window over this allocation on ``engine``'s communicator (collective the first time)."""
        win = self.windows.get(id(engine))
        if win is None or win.closed:
            win = Window.register(engine, self.ptr, self.nbytes)
            self.windows[id(engine)] = win
        return win

    def free(self) -> None:
        """Deregisters the windows and frees the memory now (tensors over it must not be used)."""
        if not self.freed:
            self.freed = True
            self._finalizer()


_U64 = (1 << 64) - 1


class Window:
    """A registered window on one communicator."""

    def __init__(self, engine: Engine, handle: int, ptr: int, nbytes: int) -> None:
        self.engine = engine
        self.lib = engine.lib
        self.handle = ctypes.c_void_p(handle)
        self.ptr = ptr
        self.nbytes = nbytes
        self.closed = False

    @classmethod
    def register(cls, engine: Engine, ptr: int, nbytes: int) -> Window:
        """ncclCommWindowRegister, collective over ``engine``'s communicator."""

        def do_register():
            win = ctypes.c_void_p()
            engine._check(
                engine.lib.ncclCommWindowRegister(engine.handle, ptr, nbytes, _byref(win), _lib.WIN_COLL_SYMMETRIC),
                "ncclCommWindowRegister",
            )
            return win.value

        engine.flush_p2p()
        # No barrier afterwards: the library puts the window in this rank's table before any
        # rank leaves the registration, so peers' one-sided calls may follow at once.
        handle = engine.executor.call(lambda: _register_with_pad_size(engine, do_register))
        if not handle:
            raise CommError("comm: ncclCommWindowRegister gave no window", call="ncclCommWindowRegister")
        return cls(engine, handle, ptr, nbytes)

    def check(self, result: int, call: str) -> None:
        if result:
            self.lib.check(result, call, self.engine.handle)

    def _live(self):
        if self.closed:
            raise CommError("comm: the window was deregistered or freed", call="window")
        if self.engine._destroyed:
            raise CommError(f"comm: communicator {self.engine.name} was shut down", call="window")

    def peer_ptr(self, peer: int) -> int:
        self._live()
        out = ctypes.c_void_p()
        self.check(self.lib.commWinPeerPtr(self.engine.handle, self.handle, peer, _byref(out)), "commWinPeerPtr")
        return out.value or 0

    def peer_size(self, peer: int) -> int:
        """The bytes of ``peer``'s part of the window (sizes may differ between ranks)."""
        self._live()
        out = ctypes.c_size_t()
        self.check(self.lib.commWinPeerSize(self.engine.handle, self.handle, peer, _byref(out)), "commWinPeerSize")
        return out.value

    def fetch_add(self, peer: int, offset: int, value: int) -> int:
        """commWinFetchAdd: adds ``value`` (mod 2**64) to the 8-byte word at byte ``offset`` of
        ``peer``'s part; returns the word's previous value."""
        self._live()
        old = ctypes.c_uint64()
        self.check(
            self.lib.commWinFetchAdd(
                value & _U64, _byref(old), _lib.UINT64, peer, self.handle, offset, self.engine.handle
            ),
            "commWinFetchAdd",
        )
        return old.value

    def compare_swap(self, peer: int, offset: int, compare: int, value: int) -> int:
        """commWinCompareSwap: sets that word to ``value`` if it holds ``compare``; returns the
        value found (the swap happened when it equals ``compare``)."""
        self._live()
        old = ctypes.c_uint64()
        self.check(
            self.lib.commWinCompareSwap(
                compare & _U64, value & _U64, _byref(old), _lib.UINT64, peer, self.handle, offset, self.engine.handle
            ),
            "commWinCompareSwap",
        )
        return old.value

    def signal_pads(self, peer: int) -> tuple[int, int]:
        self._live()
        out, nch = ctypes.c_void_p(), ctypes.c_int()
        self.check(
            self.lib.commWinSignalPads(self.engine.handle, self.handle, peer, _byref(out), _byref(nch)),
            "commWinSignalPads",
        )
        return out.value or 0, nch.value

    def channel_signal(self, peer: int, channel: int, timeout_ms: int) -> None:
        self._live()
        self.check(
            self.lib.commWinChannelSignal(peer, channel, timeout_ms, self.handle, self.engine.handle),
            "commWinChannelSignal",
        )

    def channel_wait(self, peer: int, channel: int, timeout_ms: int) -> None:
        self._live()
        self.check(
            self.lib.commWinChannelWait(peer, channel, timeout_ms, self.handle, self.engine.handle),
            "commWinChannelWait",
        )

    def channel_barrier(self, channel: int, timeout_ms: int) -> None:
        self._live()
        self.check(
            self.lib.commWinChannelBarrier(channel, timeout_ms, self.handle, self.engine.handle),
            "commWinChannelBarrier",
        )

    def deregister(self) -> None:
        """Local. A destroyed communicator has deregistered its windows already."""
        if self.closed:
            return
        self.closed = True
        if not self.engine._destroyed:
            self.lib.ncclCommWindowDeregister(self.engine.handle, self.handle)
