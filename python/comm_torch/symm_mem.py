"""``torch.distributed._symmetric_memory`` for CPU tensors, over comm's windows.

PyTorch has no CPU SymmetricMemory; this module offers its names and semantics on host
memory::

    from comm_torch import symm_mem

    t = symm_mem.empty(1024, dtype=torch.float32)        # local, shared host memory
    hdl = symm_mem.rendezvous(t, group)                  # collective; group on backend "comm"
    peer = hdl.get_buffer((hdl.rank + 1) % hdl.world_size, (1024,), torch.float32)
    peer.fill_(hdl.rank)                                 # stores straight into the peer's memory
    hdl.barrier()                                        # every rank's stores are visible now

``empty`` allocates with ``commMemAllocShared``; ``rendezvous`` registers the allocation as a
window of the group's comm communicator (once per allocation and group) and returns a handle
whose ``buffer_ptrs`` are the addresses at which this process reaches each rank's memory.
Ranks on the same host map each other's memory, so ``get_buffer`` and ``get_signal_pad`` give
tensors that alias the peer's memory; for a rank on another host its pointer is 0 and those
calls raise (the channel calls ``put_signal``, ``wait_signal`` and ``barrier`` work across hosts).
Signal pads follow PyTorch's layout: rank R's pad holds ``world_size * channel + peer`` uint32
words, and they are zero again after every completed synchronisation. ``timeout_ms=0`` waits
as long as the library's ``COMM_TIMEOUT`` allows; a wait that times out raises ``CommError``
(result ``ncclTimeout``) instead of hanging.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from . import _lib, _window
from ._lib import CommError
from ._window import Allocation, Window, bytes_tensor, engine_of, typed_view

__all__ = [
    "SymmetricMemory",
    "empty",
    "get",
    "get_backend",
    "get_mem_pool",
    "get_mempool_allocator",
    "get_signal_pad_size",
    "is_nvshmem_available",
    "is_symm_mem_tensor",
    "put_signal",
    "rendezvous",
    "set_backend",
    "set_signal_pad_size",
    "wait_signal",
]

BACKEND = "COMM"


def _shape(size: tuple[Any, ...]) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    return tuple(int(s) for s in size)


def _check_device(device: Any) -> None:
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"comm_torch.symm_mem: only CPU tensors are supported, not device {device}")


def empty(*size: Any, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """An uninitialised (zero-filled) CPU tensor in shared host memory, for ``rendezvous``.
    Local, like torch's ``empty``; the memory is freed with the last tensor over it."""
    _check_device(device)
    shape = _shape(size)
    dtype = dtype or torch.get_default_dtype()
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = torch.Size(shape).numel() * elem
    _, raw = Allocation.create(nbytes)
    return typed_view(raw, shape, dtype)


def is_symm_mem_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lies in memory from ``empty`` (or ``allocate_symmetric_memory``)."""
    return Allocation.of(tensor) is not None


def get_backend(device: torch.device | str | None = None) -> str | None:
    """ "COMM" for CPU, None for other devices."""
    if device is not None and torch.device(device).type != "cpu":
        return None
    return BACKEND


def set_backend(name: str) -> None:
    """Chooses the allocation backend. There is one on CPU, "COMM", so this accepts that name
    (a no-op) and, like PyTorch for a backend it does not have, raises RuntimeError for any
    other."""
    if name != BACKEND:
        raise RuntimeError(f"SymmetricMemory does not find allocation backend {name} (comm_torch has only {BACKEND})")


def is_nvshmem_available() -> bool:
    """False: comm_torch's symmetric memory is host memory, not NVSHMEM's."""
    return False


def get_mempool_allocator(device: torch.device | str) -> Any:
    """PyTorch's MemPool allocator for symmetric memory; there is no CPU MemPool in PyTorch, so
    this raises RuntimeError (allocate with ``empty`` instead)."""
    _check_device(device)
    raise RuntimeError("comm_torch.symm_mem: PyTorch has no MemPool for CPU tensors; allocate with symm_mem.empty")


def get_mem_pool(device: torch.device | str) -> Any:
    """As ``get_mempool_allocator``: RuntimeError on CPU (use ``empty``)."""
    return get_mempool_allocator(device)


def set_signal_pad_size(size: int) -> None:
    """Sets the signal pad size in bytes of the windows made from now on. Like PyTorch's, it
    must come before the first ``rendezvous`` (or any other window of comm_torch) in the
    process, and it must be the same on every rank; a later call raises RuntimeError. A
    communicator of N ranks gets ``size // (4 * N)`` channels (at least one) per window."""
    size = int(size)
    if size < 4:
        raise ValueError(f"comm_torch.symm_mem: a signal pad of {size} bytes holds no signal")
    if _window.windows_made() and size != get_signal_pad_size():
        raise RuntimeError("comm_torch.symm_mem: set_signal_pad_size must be called before the first rendezvous")
    _window.set_pad_bytes(size)


def get_signal_pad_size() -> int:
    """The signal pad size in bytes: the value ``set_signal_pad_size`` set, else that of the
    library's default (``COMM_WIN_CHANNELS``, 32 channels) for the default group's size (1
    before torch.distributed is initialised). A handle's ``signal_pad_size`` is its own."""
    if _window.pad_bytes() is not None:
        return _window.pad_bytes()
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    return _window.default_channels() * 4 * world


class SymmetricMemory:
    """The handle ``rendezvous`` returns: PyTorch's ``_SymmetricMemory`` on host memory."""

    def __init__(self, window: Window, offset: int, device: torch.device) -> None:
        self._window = window
        engine = window.engine
        self.rank: int = engine.rank
        self.world_size: int = engine.size
        self.buffer_size: int = window.nbytes
        # As PyTorch's rendezvous: the allocations must be the same size on every rank (every
        # rank sees the same sizes, so every rank raises). Each rank's buffer pointer then
        # covers buffer_size bytes, which get_buffer and get rely on.
        sizes = [window.peer_size(r) for r in range(self.world_size)]
        if any(n != self.buffer_size for n in sizes):
            raise RuntimeError(
                "comm_torch.symm_mem.rendezvous: the ranks' allocations differ in size "
                f"({', '.join(f'rank {r}: {n} bytes' for r, n in enumerate(sizes))}); "
                "symmetric memory needs the same size on every rank"
            )
        self.offset: int = offset
        self.device: torch.device = device
        self.buffer_ptrs: list[int] = [window.peer_ptr(r) for r in range(self.world_size)]
        pads = [window.signal_pads(r) for r in range(self.world_size)]
        self.signal_pad_ptrs: list[int] = [p for p, _ in pads]
        self._channels = pads[self.rank][1]
        self.signal_pad_size: int = self._channels * self.world_size * 4
        self._buffer_ptrs_arr: Any = None
        self._signal_pad_ptrs_arr: Any = None

    def __repr__(self) -> str:
        return f"SymmetricMemory(rank={self.rank}, world_size={self.world_size}, buffer_size={self.buffer_size})"

    # -- direct access
    def _peer(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"comm_torch.symm_mem: rank {rank} is out of range for world size {self.world_size}")
        return rank

    def get_buffer(
        self,
        rank: int,
        sizes: Sequence[int] | torch.Size,
        dtype: torch.dtype,
        storage_offset: int = 0,
    ) -> torch.Tensor:
        """A tensor over ``rank``'s buffer (shape ``sizes``, ``storage_offset`` in elements of
        ``dtype``) that aliases that rank's memory: stores to it land there at once."""
        ptr = self.buffer_ptrs[self._peer(rank)]
        if not ptr:
            raise CommError(
                f"comm_torch.symm_mem: rank {rank}'s buffer is not addressable from this process "
                "(another host); use the channel calls or comm_torch.rdma for it",
                call="get_buffer",
            )
        elem = torch.empty((), dtype=dtype).element_size()
        raw = bytes_tensor(ptr, self.buffer_size, keep=self)
        return typed_view(raw, sizes, dtype, storage_offset * elem)

    def get_remote_tensor(self, peer: int, sizes: Sequence[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """``get_buffer`` at the offset of the tensor this handle was made from."""
        elem = torch.empty((), dtype=dtype).element_size()
        if self.offset % elem:
            raise ValueError(f"comm_torch.symm_mem: offset {self.offset} is not a multiple of {dtype}'s size")
        return self.get_buffer(peer, sizes, dtype, self.offset // elem)

    def get_signal_pad(
        self,
        rank: int,
        sizes: Sequence[int] | torch.Size | None = None,
        dtype: torch.dtype | None = None,
        storage_offset: int = 0,
    ) -> torch.Tensor:
        """``rank``'s signal pad as a tensor (uint32, the whole pad by default)."""
        ptr = self.signal_pad_ptrs[self._peer(rank)]
        if not ptr:
            raise CommError(
                f"comm_torch.symm_mem: rank {rank}'s signal pad is not addressable from this process (another host)",
                call="get_signal_pad",
            )
        dtype = dtype or torch.uint32
        elem = torch.empty((), dtype=dtype).element_size()
        if not sizes:
            sizes = ((self.signal_pad_size - storage_offset * elem) // elem,)
        raw = bytes_tensor(ptr, self.signal_pad_size, keep=self)
        return typed_view(raw, sizes, dtype, storage_offset * elem)

    # -- synchronisation (the caller's thread; several threads may use different channels)
    def _channel(self, channel: int) -> int:
        if not 0 <= channel < self._channels:
            raise ValueError(f"comm_torch.symm_mem: channel {channel} is out of range (0..{self._channels - 1})")
        return channel

    def barrier(self, channel: int = 0, timeout_ms: int = 0) -> None:
        """Signals every rank on ``channel``, then waits for every rank's signal."""
        self._window.channel_barrier(self._channel(channel), timeout_ms)

    def put_signal(self, dst_rank: int, channel: int = 0, timeout_ms: int = 0) -> None:
        """Sets this rank's word for ``channel`` in ``dst_rank``'s pad (waiting while it is set)."""
        self._window.channel_signal(self._peer(dst_rank), self._channel(channel), timeout_ms)

    def wait_signal(self, src_rank: int, channel: int = 0, timeout_ms: int = 0) -> None:
        """Waits for ``src_rank``'s signal on ``channel`` and clears it."""
        self._window.channel_wait(self._peer(src_rank), self._channel(channel), timeout_ms)

    # -- helpers PyTorch offers on the handle
    @staticmethod
    def memset32(tensor: torch.Tensor, offset: int, val: int, count: int = 1) -> None:
        """Sets ``count`` 32-bit words of ``tensor`` from word ``offset`` to ``val``."""
        words = tensor.view(torch.uint32) if tensor.element_size() == 4 else tensor.view(-1).view(torch.uint32)
        words.view(-1)[offset : offset + count] = val

    @staticmethod
    def stream_write_value32(tensor: torch.Tensor, offset: int, val: int) -> None:
        """Writes the 32-bit word ``offset`` of ``tensor`` (at once: there is no stream on CPU)."""
        SymmetricMemory.memset32(tensor, offset, val, 1)

    # On CUDA these are device arrays of world_size pointers that kernels index; on CPU they
    # are host arrays (uint64 each) of the same addresses as buffer_ptrs / signal_pad_ptrs,
    # valid as long as the handle.
    @property
    def buffer_ptrs_dev(self) -> int:
        """The address of a host array of ``world_size`` 64-bit pointers: ``buffer_ptrs``."""
        if self._buffer_ptrs_arr is None:
            self._buffer_ptrs_arr = (ctypes.c_uint64 * self.world_size)(*self.buffer_ptrs)
        return ctypes.addressof(self._buffer_ptrs_arr)

    @property
    def signal_pad_ptrs_dev(self) -> int:
        """The address of a host array of ``world_size`` 64-bit pointers: ``signal_pad_ptrs``."""
        if self._signal_pad_ptrs_arr is None:
            self._signal_pad_ptrs_arr = (ctypes.c_uint64 * self.world_size)(*self.signal_pad_ptrs)
        return ctypes.addressof(self._signal_pad_ptrs_arr)

    def boxed(self) -> SymmetricMemory:
        """PyTorch 2.15 converts its handle for the dispatcher; this one is its own."""
        return self

    @property
    def multicast_ptr(self) -> int:
        return 0

    def has_multicast_support(self) -> bool:
        return False


def rendezvous(tensor: torch.Tensor, group: Any = None) -> SymmetricMemory:
    """Collective over ``group`` (a ProcessGroup on backend "comm", its name, or None for the
    default group): registers ``tensor``'s allocation as a window and returns the handle.
    Cached: later calls for the same allocation and group return the same handle."""
    _check_device(tensor.device)
    alloc = Allocation.of(tensor)
    if alloc is None:
        raise ValueError("comm_torch.symm_mem.rendezvous: the tensor was not allocated with comm_torch.symm_mem.empty")
    engine = engine_of(group)
    offset = tensor.data_ptr() - alloc.ptr
    key = (id(engine), offset)
    handle = alloc.handles.get(key)
    if handle is None or handle._window.closed:
        handle = SymmetricMemory(alloc.window(engine), offset, tensor.device)
        alloc.handles[key] = handle
    return handle


# -- one-sided module functions (PyTorch 2.15: backend "NCCL" only there; comm_torch has them on CPU)
def _check_peer(hdl: SymmetricMemory, peer: int, what: str) -> None:
    if not 0 <= peer < hdl.world_size:
        raise ValueError(f"{what}: invalid peer")


def get(dst: torch.Tensor, hdl: SymmetricMemory, peer: int, offset: int = 0) -> None:
    """Copies ``dst.numel()`` elements from ``peer``'s allocation behind ``hdl``, from
    ``offset`` elements (of ``dst``'s dtype) past the handle's tensor, into ``dst``: straight
    from the peer's memory on this host, through a one-sided read across hosts."""
    if dst.device != hdl.device:
        raise ValueError("get: dst must be on the same device as hdl")
    if not dst.is_contiguous():
        raise ValueError("get: dst must be backed by contiguous memory")
    if offset < 0:
        raise ValueError("get: offset must be non-negative")
    _check_peer(hdl, peer, "get")
    size, elem = dst.numel(), dst.element_size()
    if hdl.offset % elem:
        raise RuntimeError("get: handle offset is not element-aligned")
    start = hdl.offset + offset * elem
    if start + size * elem > hdl.buffer_size:
        raise ValueError("get: requested range exceeds symmetric allocation")
    if size == 0:
        return
    if hdl.buffer_ptrs[peer]:
        dst.view(-1).copy_(hdl.get_buffer(peer, (size,), dst.dtype, start // elem))
        return
    win = hdl._window
    win.check(
        win.lib.commWinGet(
            ctypes.c_void_p(dst.data_ptr()), size * elem, _lib.UINT8, peer, win.handle, start, win.engine.handle
        ),
        "commWinGet",
    )


def put_signal(src: torch.Tensor, hdl: SymmetricMemory, peer: int) -> None:
    """ncclPutSignal, as PyTorch's NCCL backend: writes ``src`` into ``peer``'s allocation at
    the handle's tensor and counts one signal there (signals are counted per sender and
    communicator, apart from the channel signal pads). Complete when it returns."""
    if src.device != hdl.device:
        raise ValueError("put_signal: src must be on the same device as hdl")
    _check_peer(hdl, peer, "put_signal")
    src = src.contiguous()
    nbytes = src.numel() * src.element_size()
    if hdl.offset + nbytes > hdl.buffer_size:
        raise ValueError("put_signal: the source exceeds the symmetric allocation")
    win = hdl._window
    win._live()
    win.check(
        win.lib.ncclPutSignal(
            ctypes.c_void_p(src.data_ptr()),
            nbytes,
            _lib.UINT8,
            peer,
            win.handle,
            hdl.offset,
            0,
            0,
            0,
            win.engine.handle,
            None,
        ),
        "ncclPutSignal",
    )


def wait_signal(hdl: SymmetricMemory, peer: int) -> None:
    """ncclWaitSignal for one signal from ``peer``: returns once a ``put_signal`` (or another
    counted signal) from it has arrived, with its data in place; consumes that signal."""
    _check_peer(hdl, peer, "wait_signal")
    win = hdl._window
    win._live()
    desc = _lib.WaitSignalDesc(1, peer, 0, 0)
    win.check(win.lib.ncclWaitSignal(1, ctypes.byref(desc), win.engine.handle, None), "ncclWaitSignal")
