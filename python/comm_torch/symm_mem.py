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

from collections.abc import Sequence
from typing import Any

import torch

from ._lib import CommError
from ._window import Allocation, Window, bytes_tensor, engine_of, typed_view

__all__ = [
    "SymmetricMemory",
    "empty",
    "get_backend",
    "is_symm_mem_tensor",
    "rendezvous",
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


class SymmetricMemory:
    """The handle ``rendezvous`` returns: PyTorch's ``_SymmetricMemory`` on host memory."""

    def __init__(self, window: Window, offset: int, device: torch.device) -> None:
        self._window = window
        engine = window.engine
        self.rank: int = engine.rank
        self.world_size: int = engine.size
        self.buffer_size: int = window.nbytes
        self.offset: int = offset
        self.device: torch.device = device
        self.buffer_ptrs: list[int] = [window.peer_ptr(r) for r in range(self.world_size)]
        pads = [window.signal_pads(r) for r in range(self.world_size)]
        self.signal_pad_ptrs: list[int] = [p for p, _ in pads]
        self._channels = pads[self.rank][1]
        self.signal_pad_size: int = self._channels * self.world_size * 4

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

    @property
    def buffer_ptrs_dev(self) -> int:
        raise NotImplementedError("comm_torch.symm_mem: CPU handles have no device pointer arrays; use buffer_ptrs")

    @property
    def signal_pad_ptrs_dev(self) -> int:
        raise NotImplementedError("comm_torch.symm_mem: CPU handles have no device pointer arrays; use signal_pad_ptrs")

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
