"""monarch.rdma's ``RDMABuffer`` on comm's windows: one-sided reads, writes and 8-byte atomics
on another process's CPU tensor, on this host or another.

Monarch hands a buffer to other processes by sending the object; here creation is collective
over a group on backend "comm": every rank wraps its own tensor, and ``buf.on(rank)`` is the
buffer that ``rank`` wrapped, which this rank then reads, writes and updates without that
rank taking part::

    buf = RDMABuffer(torch.zeros(1024, dtype=torch.uint8))   # on every rank
    peer = buf.on(1)
    peer.write_from(torch.ones(1024, dtype=torch.uint8)).get()
    old = torch.zeros(1, dtype=torch.int64)
    peer.fetch_add(old, 5).get()                              # old = previous first word

Operations return a ``Future`` with ``get()`` that can also be awaited; ``timeout`` (seconds)
bounds the wait, after which ``get`` raises TimeoutError.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Generator
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from . import _lib
from ._window import Window, engine_of

__all__ = ["Future", "RDMABuffer"]

T = TypeVar("T")

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="comm-rdma")
        return _pool


class Future(Generic[T]):
    """The result of an RDMA operation: ``get()`` blocks (up to the operation's timeout),
    ``await`` waits without blocking the event loop."""

    def __init__(self, inner: concurrent.futures.Future, timeout: float | None) -> None:
        self._inner = inner
        self._timeout = timeout

    def get(self, timeout: float | None = None) -> T:
        limit = self._timeout if timeout is None else timeout
        try:
            return self._inner.result(limit)
        except concurrent.futures.TimeoutError as err:
            raise TimeoutError(f"comm_torch.rdma: the operation did not finish in {limit} s") from err

    def done(self) -> bool:
        return self._inner.done()

    def __await__(self) -> Generator[Any, None, T]:
        async def wait() -> T:
            try:
                return await asyncio.wait_for(asyncio.wrap_future(self._inner), self._timeout)
            except asyncio.TimeoutError as err:
                raise TimeoutError(f"comm_torch.rdma: the operation did not finish in {self._timeout} s") from err

        return wait().__await__()


def _as_bytes(data: torch.Tensor | memoryview, what: str) -> torch.Tensor:
    """``data`` as a 1-D contiguous uint8 CPU tensor over the same memory."""
    if isinstance(data, memoryview):
        if data.ndim != 1 or not data.c_contiguous:
            raise ValueError(f"comm_torch.rdma: {what} must be a 1-d c-contiguous memoryview")
        if data.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.frombuffer(data, dtype=torch.uint8)
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"comm_torch.rdma: {what} must be a torch.Tensor or a memoryview, not {type(data).__name__}")
    if data.device.type != "cpu":
        raise ValueError(f"comm_torch.rdma: {what} must be a CPU tensor, not on {data.device}")
    if not data.is_contiguous():
        raise ValueError(f"comm_torch.rdma: {what} must be contiguous")
    return data.reshape(-1).view(torch.uint8) if data.numel() else torch.empty(0, dtype=torch.uint8)


def _signed64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


class _Deregister:
    def __init__(self, window: Window) -> None:
        self.window = window

    def __del__(self) -> None:
        self.window.deregister()


class RDMABuffer:
    """monarch.rdma.RDMABuffer over a window of the group's comm communicator.

    ``RDMABuffer(data, group=None)`` is collective over ``group`` (the default group when
    None): every rank passes a 1-d contiguous CPU tensor or memoryview of at least one byte
    (ValueError otherwise, on that rank; the others then fail too, so check before). The
    object refers to this rank's data; ``on(rank)`` to ``rank``'s."""

    def __init__(self, data: torch.Tensor | memoryview, *, group: Any = None) -> None:
        if isinstance(data, torch.Tensor) and data.dim() != 1:
            raise ValueError("comm_torch.rdma.RDMABuffer: data must be 1-d")
        raw = _as_bytes(data, "data")
        if raw.numel() == 0:
            raise ValueError("comm_torch.rdma.RDMABuffer: data has size 0")
        engine = engine_of(group)
        sizes = torch.zeros(engine.size, dtype=torch.int64)
        sizes[engine.rank] = raw.numel()
        dist.all_reduce(sizes, group=group)
        self._data = data
        self._raw = raw
        self._window = Window.register(engine, raw.data_ptr(), raw.numel())
        self._sizes = [int(s) for s in sizes]
        self._owner = engine.rank
        # The window goes with the last view of it (this object and those ``on`` made share it).
        self._life = _Deregister(self._window)

    @classmethod
    def _view(cls, base: RDMABuffer, owner: int) -> RDMABuffer:
        buf = cls.__new__(cls)
        buf.__dict__.update(base.__dict__)
        buf._owner = owner
        return buf

    def on(self, rank: int) -> RDMABuffer:
        """The buffer ``rank`` registered in the same collective call."""
        if not 0 <= rank < len(self._sizes):
            raise ValueError(f"comm_torch.rdma: rank {rank} is out of range for {len(self._sizes)} ranks")
        return RDMABuffer._view(self, rank)

    @property
    def owner(self) -> int:
        """The rank whose memory this buffer is."""
        return self._owner

    @property
    def backend(self) -> str:
        return "comm"

    def size(self) -> int:
        """Bytes in the buffer."""
        return self._sizes[self._owner]

    # -- operations
    def _submit(self, fn: Any, timeout: float | None) -> Future:
        return Future(_executor().submit(fn), timeout)

    def _check(self, result: int, call: str) -> None:
        self._window.check(result, call)

    def read_into(self, dst: torch.Tensor | memoryview, *, timeout: float = 3) -> Future[None]:
        """Reads the whole buffer into the start of ``dst`` (ValueError if ``dst`` is smaller)."""
        local = _as_bytes(dst, "dst")
        if local.numel() < self.size():
            raise ValueError(f"comm_torch.rdma: dst has {local.numel()} bytes, the buffer {self.size()}")
        win, owner, n = self._window, self._owner, self.size()

        def run() -> None:
            win._live()
            self._check(
                win.lib.commWinGet(local.data_ptr(), n, _lib.UINT8, owner, win.handle, 0, win.engine.handle),
                "commWinGet",
            )

        return self._submit(run, timeout)

    def write_from(self, src: torch.Tensor | memoryview, *, timeout: float = 3) -> Future[None]:
        """Writes ``src`` at the start of the buffer (ValueError if it is larger); complete,
        in the owner's memory, when the future resolves."""
        local = _as_bytes(src, "src")
        if local.numel() > self.size():
            raise ValueError(f"comm_torch.rdma: src has {local.numel()} bytes, the buffer only {self.size()}")
        win, owner = self._window, self._owner

        def run() -> None:
            win._live()
            if local.numel():
                self._check(
                    win.lib.commWinPut(
                        local.data_ptr(), local.numel(), _lib.UINT8, owner, win.handle, 0, win.engine.handle
                    ),
                    "commWinPut",
                )
            self._check(win.lib.commWinFlush(owner, win.handle, win.engine.handle), "commWinFlush")

        return self._submit(run, timeout)

    def _atomic_target(self, dst: torch.Tensor | memoryview, offset: int) -> torch.Tensor:
        local = _as_bytes(dst, "dst")
        if local.numel() < 8:
            raise ValueError(f"comm_torch.rdma: dst must hold 8 bytes for the old value, it has {local.numel()}")
        if offset < 0 or offset % 8 or offset + 8 > self.size():
            raise ValueError(
                f"comm_torch.rdma: offset {offset} must be a multiple of 8 within the buffer's {self.size()} bytes"
            )
        return local[:8]

    def _store_old(self, local: torch.Tensor, old: int) -> None:
        local.copy_(torch.tensor([_signed64(old)], dtype=torch.int64).view(torch.uint8))

    def fetch_add(
        self, dst: torch.Tensor | memoryview, add: int, *, offset: int = 0, timeout: float = 3
    ) -> Future[int]:
        """Atomically adds ``add`` to the 8-byte integer at byte ``offset`` of the buffer; the
        previous value lands in the first 8 bytes of ``dst`` (and is the future's result)."""
        local = self._atomic_target(dst, offset)
        win, owner = self._window, self._owner

        def run() -> int:
            old = win.fetch_add(owner, offset, add)
            self._store_old(local, old)
            return _signed64(old)

        return self._submit(run, timeout)

    def compare_and_swap(
        self,
        dst: torch.Tensor | memoryview,
        compare: int,
        swap: int,
        *,
        offset: int = 0,
        timeout: float = 3,
    ) -> Future[int]:
        """Atomically replaces the 8-byte integer at byte ``offset`` with ``swap`` if it equals
        ``compare``; the value found lands in ``dst`` (and is the future's result)."""
        local = self._atomic_target(dst, offset)
        win, owner = self._window, self._owner

        def run() -> int:
            old = win.compare_swap(owner, offset, compare, swap)
            self._store_old(local, old)
            return _signed64(old)

        return self._submit(run, timeout)

    def drop(self) -> Future[None]:
        """Deregisters this rank's window (local); peers must no longer use it."""
        win = self._window

        def run() -> None:
            win.deregister()

        return self._submit(run, None)
