"""The torchcomms backend "comm".

torchcomms (0.3 and later) accepts backends written in Python: a subclass of
``TorchCommBackend`` registered with ``register_backend(name, cls)``. Its C++ side
(comms/torchcomms/TorchCommBackendPy.cpp in meta-pytorch/torchcomms) creates one instance per
communicator, calls ``init(device, name, options)``, and forwards each collective as
``method(tensors..., async_op)`` (``all_reduce(tensor, op, async_op)``,
``reduce(tensor, root, op, async_op)``, ``all_to_all_v_single(output, input, output_split_sizes,
input_split_sizes, async_op)``, ...). A method returns None once the operation is complete, or
an object with ``wait()``. ``split(ranks, name, options)`` returns a new backend instance.
Rank and size come from the environment (TORCHCOMM_RANK / TORCHCOMM_SIZE, which
torch.distributed sets, else RANK / WORLD_SIZE), the store from ``options.store`` or from
MASTER_ADDR / MASTER_PORT.

torchcomms finds this module through the ``torchcomms.backends`` entry point named "comm"
(``torchcomms._load_backend`` loads it when ``new_comm("comm", ...)`` meets an unknown name);
importing it registers the class.

Windows follow torchcomms main's API (``new_window``, then ``tensor_register``, ``put``,
``signal``, ``wait_signal``, ``get_tensor``, ``map_remote_tensor`` on the window; see
CommWindow), on host memory through libcomm's NCCL windows; ``window_allocate`` gives a
window over shared host memory.
"""

from __future__ import annotations

import ctypes
import datetime
import functools
import operator
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from . import _lib
from ._core import CommWork, Engine, Reduction, operation_limit, timeout_seconds
from ._lib import CommError

try:
    from torchcomms._comms import TorchCommBackend, _is_backend_registered, register_backend
except ImportError:  # the names are also re-exported at the top level in some releases
    from torchcomms import TorchCommBackend, _is_backend_registered, register_backend

BACKEND_NAME = "comm"


_KINDS = ("sum", "product", "min", "max", "avg", "band", "bor", "bxor", "premul_sum")


def reduction(op: Any) -> Reduction:
    """The engine's Reduction for a torchcomms ReduceOp (``op.type`` is a RedOpType)."""
    kind_obj = getattr(op, "type", op)
    name = getattr(kind_obj, "name", None) or str(kind_obj).rsplit(".", 1)[-1]
    kind = name.lower()
    if kind not in _KINDS:
        raise ValueError(f"comm: unsupported reduce op {op}")
    if kind == "premul_sum":
        factor = getattr(op, "factor", None)
        if factor is None:
            raise ValueError(
                "comm: PREMUL_SUM reached this backend without its factor (torchcomms passes Python "
                "backends a ReduceOp whose factor they cannot read); multiply the input by the factor "
                "and use SUM"
            )
        return Reduction(kind, factor)
    return Reduction(kind)


def _env_int(*names):
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return None


def _rank_and_size():
    rank = _env_int("TORCHCOMM_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
    size = _env_int("TORCHCOMM_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
    if rank is None or size is None:
        raise RuntimeError("comm: set TORCHCOMM_RANK and TORCHCOMM_SIZE (or RANK and WORLD_SIZE)")
    return rank, size


def _store(options):
    store = getattr(options, "store", None)
    if store is not None:
        return store
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise RuntimeError("comm: no store in the options, and MASTER_ADDR / MASTER_PORT are not set")
    rank, _ = _rank_and_size()
    timeout = getattr(options, "timeout", None)
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(minutes=10)
    return torch.distributed.TCPStore(addr, int(port), is_master=(rank == 0), wait_for_workers=False, timeout=timeout)


class CommWindow:
    """A window of the torchcomms API as it stands on torchcomms main (``new_window``,
    ``tensor_register``, ``put``, ``signal``, ``wait_signal``, ``get_tensor``,
    ``map_remote_tensor``, ``get_size``), over an NCCL window of libcomm on host memory, and
    of the seed's older API, told apart by their arguments: ``signal(signal_disp, signal_val,
    dst_rank, async_op)`` sets word ``signal_disp`` of ``dst_rank``'s signal buffer
    (``signal_size`` uint64 words, zero at registration) to ``signal_val`` once this rank's
    puts to it have landed; ``wait_signal(signal_disp, signal_val, cmp_op, async_op)`` waits
    until this rank's word compares to ``signal_val`` as ``cmp_op`` (EQ, NE, LT, LE, GT, GE)
    says; ``get_tensor(rank, sizes, dtype, offset)`` is ``rank``'s memory from element
    ``offset`` (aliasing it where this process can address it, else a copy).

    ``put`` is ncclPutSignal (one counted signal per put, as torchcomms' NCCL backend does),
    ``signal`` ncclSignal, ``wait_signal`` ncclWaitSignal for one signal; signals are counted
    per sender, so put() + signal() deliver two. Offsets are in elements of the source
    tensor's dtype. Operations are complete when they return; ``async_op`` gives a completed
    work. ``map_remote_tensor`` works for peers on this host whose window memory is shared
    (tensors from ``window_allocate`` or ``comm_torch.symm_mem.empty``), else it raises."""

    def __init__(self, engine: Engine, tensor: torch.Tensor | None = None, signal_size: int = 256) -> None:
        if signal_size < 1:
            raise ValueError(f"comm: signal_size is {signal_size}; a window needs at least one signal word")
        self._engine = engine
        self._tensor: torch.Tensor | None = None
        self._owning = True
        self._window = None
        self._signal_size = int(signal_size)
        # The seed API's signal words: their allocation, a tensor over it (which keeps it
        # alive) and their window, while a tensor is registered.
        self._signal_alloc = self._signal_words = self._signal_win = None
        if tensor is not None:
            self.tensor_register(tensor)

    # -- registration
    def tensor_register(self, tensor: torch.Tensor, owning: bool = True) -> None:
        """Collective: registers ``tensor`` (contiguous, CPU) as this window's memory."""
        from ._window import Allocation, Window

        if self._window is not None:
            raise RuntimeError("comm: this window already has a registered tensor; tensor_deregister first")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("comm: window tensors must be contiguous CPU tensors")
        self._window = Window.register(self._engine, tensor.data_ptr(), tensor.numel() * tensor.element_size())
        self._tensor, self._owning = tensor, owning
        # The signal words, shared memory so that peers on this host set them with hardware
        # atomics (registered here, where every rank is, though only the seed API uses them).
        self._signal_alloc, self._signal_words = Allocation.create(self._signal_size * 8)
        self._signal_win = self._signal_alloc.window(self._engine)

    def tensor_deregister(self) -> None:
        """Collective: barrier, forget the tensor, barrier (as torchcomms' NCCL backend)."""
        self._live()
        self._engine.barrier(False, None)
        win, self._window, self._tensor = self._window, None, None
        alloc = self._signal_alloc
        self._signal_alloc = self._signal_words = self._signal_win = None
        win.deregister()
        if alloc is not None:
            alloc.free()
        self._engine.barrier(False, None)

    def _live(self):
        if self._window is None:
            raise RuntimeError("comm: the window has no registered tensor (tensor_register first)")
        return self._window

    # -- properties
    @property
    def dtype(self) -> torch.dtype | None:
        return self._tensor.dtype if self._tensor is not None else None

    @property
    def shape(self) -> list[int]:
        return list(self._tensor.shape) if self._tensor is not None else []

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def get_size(self) -> int:
        """Registered bytes (0 before tensor_register)."""
        return self._window.nbytes if self._window is not None else 0

    def get_tensor(self, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        """torchcomms main: the registered tensor (None when it was registered with
        owning=False). The seed's ``get_tensor(rank, sizes, dtype, offset)``: ``rank``'s
        memory from element ``offset`` as ``dtype`` with shape ``sizes``."""
        if not args and not kwargs:
            return self._tensor if self._owning else None
        return self._remote_tensor(*args, **kwargs)

    def _remote_tensor(self, rank: int, sizes: Any, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        from ._window import bytes_tensor, typed_view

        win = self._live()
        elem = torch.empty((), dtype=dtype).element_size()
        shape = torch.Size(sizes)
        start, nbytes = int(offset) * elem, shape.numel() * elem
        size = win.peer_size(rank)
        if offset < 0 or start + nbytes > size:
            raise ValueError(
                f"comm: get_tensor of {nbytes} bytes at byte offset {start} passes rank {rank}'s window of {size} bytes"
            )
        ptr = win.peer_ptr(rank)
        if ptr:
            return typed_view(bytes_tensor(ptr, size, keep=win), shape, dtype, start)
        out = torch.empty(shape, dtype=dtype)
        if nbytes:
            win.check(
                win.lib.commWinGet(out.data_ptr(), nbytes, _lib.UINT8, rank, win.handle, start, self._engine.handle),
                "commWinGet",
            )
        return out

    def get_attr(self, peer_rank: int) -> Any:
        unified = self._live().peer_ptr(peer_rank) != 0
        try:
            from torchcomms import TorchCommWinAccessType, TorchCommWindowAttr

            attr = TorchCommWindowAttr()
            attr.access_type = (
                TorchCommWinAccessType.WIN_ACCESS_TYPE_UNIFIED
                if unified
                else TorchCommWinAccessType.WIN_ACCESS_TYPE_SEPARATE
            )
            return attr
        except (ImportError, AttributeError, TypeError):
            return "WIN_ACCESS_TYPE_UNIFIED" if unified else "WIN_ACCESS_TYPE_SEPARATE"

    def map_remote_tensor(self, rank: int) -> torch.Tensor:
        """``rank``'s registered memory as a tensor of this window's dtype and shape, aliasing it."""
        from ._window import bytes_tensor, typed_view

        win = self._live()
        ptr = win.peer_ptr(rank)
        if not ptr:
            raise RuntimeError(
                f"comm: rank {rank}'s window memory is not addressable from this process (another host, or "
                "memory not allocated with window_allocate / comm_torch.symm_mem.empty); use put/get"
            )
        size = win.peer_size(rank)
        if size < win.nbytes:
            raise ValueError(
                f"comm: rank {rank} registered {size} bytes, fewer than this rank's tensor "
                f"({win.nbytes} bytes), so its memory cannot be seen with this window's shape"
            )
        return typed_view(bytes_tensor(ptr, size, keep=win), self._tensor.shape, self._tensor.dtype)

    # -- one-sided operations
    def put(
        self,
        tensor: torch.Tensor,
        dst_rank: int,
        target_offset_nelems: int,
        async_op: bool = False,
        hints: dict[str, str] | None = None,
        timeout: datetime.timedelta | None = None,
    ) -> CommWork | None:
        """Writes ``tensor`` into ``dst_rank``'s window at ``target_offset_nelems`` elements of
        its dtype, and counts one signal there."""
        win = self._live()
        if tensor.device.type != "cpu":
            raise ValueError("comm: put needs a CPU tensor")
        src = tensor.contiguous()
        elem = src.element_size()
        offset = target_offset_nelems * elem
        size = win.peer_size(dst_rank)
        if target_offset_nelems < 0 or offset + src.numel() * elem > size:
            raise ValueError(
                f"comm: put of {src.numel() * elem} bytes at byte offset {offset} passes rank {dst_rank}'s "
                f"window of {size} bytes"
            )
        win.check(
            win.lib.ncclPutSignal(
                src.data_ptr(),
                src.numel() * elem,
                _lib.UINT8,
                dst_rank,
                win.handle,
                offset,
                0,
                0,
                0,
                self._engine.handle,
                None,
            ),
            "ncclPutSignal",
        )
        return _completed(async_op)

    def signal(self, *args: Any, **kwargs: Any) -> CommWork | None:
        """torchcomms main: ``signal(dst_rank, async_op=False, hints=None, timeout=None)``
        counts one signal at ``dst_rank``. The seed: ``signal(signal_disp, signal_val,
        dst_rank, async_op)`` sets a signal word (see the class)."""
        if "signal_disp" in kwargs or (len(args) >= 3 and _is_int(args[2])):
            return self._set_signal(*args, **kwargs)
        return self._count_signal(*args, **kwargs)

    def _count_signal(
        self,
        dst_rank: int,
        async_op: bool = False,
        hints: dict[str, str] | None = None,
        timeout: datetime.timedelta | None = None,
    ) -> CommWork | None:
        win = self._live()
        win.check(win.lib.ncclSignal(dst_rank, 0, 0, 0, self._engine.handle, None), "ncclSignal")
        return _completed(async_op)

    def _word(self, disp: int) -> tuple[Any, int]:
        """The signal window and the byte offset of word ``disp``."""
        self._live()
        if not 0 <= disp < self._signal_size:
            raise ValueError(f"comm: signal_disp {disp} is outside the {self._signal_size} signal words")
        return self._signal_win, disp * 8

    def _set_signal(self, signal_disp: int, signal_val: int, dst_rank: int, async_op: bool = False) -> CommWork | None:
        data = self._live()
        win, off = self._word(signal_disp)
        # The puts before it land first (across hosts they may still be on their way).
        data.check(win.lib.commWinFlush(dst_rank, data.handle, self._engine.handle), "commWinFlush")
        # A store as compare-and-swap: each failed swap says what to compare with next.
        seen = 0
        while True:
            found = win.compare_swap(dst_rank, off, seen, int(signal_val))
            if found == seen:
                return _completed(async_op)
            seen = found

    def wait_signal(self, *args: Any, **kwargs: Any) -> CommWork | None:
        """torchcomms main: ``wait_signal(peer_rank, async_op=False, hints=None,
        timeout=None)`` waits for (and consumes) one signal from ``peer_rank``; the data of the
        puts before it is in place. The seed: ``wait_signal(signal_disp, signal_val, cmp_op,
        async_op)`` waits on a signal word (see the class)."""
        if "cmp_op" in kwargs or (len(args) >= 3 and args[2] is not None and not isinstance(args[2], dict)):
            return self._wait_word(*args, **kwargs)
        return self._wait_count(*args, **kwargs)

    def _wait_count(
        self,
        peer_rank: int,
        async_op: bool = False,
        hints: dict[str, str] | None = None,
        timeout: datetime.timedelta | None = None,
    ) -> CommWork | None:
        win = self._live()
        desc = _lib.WaitSignalDesc(1, peer_rank, 0, 0)
        win.check(win.lib.ncclWaitSignal(1, ctypes.byref(desc), self._engine.handle, None), "ncclWaitSignal")
        return _completed(async_op)

    def _wait_word(
        self,
        signal_disp: int,
        signal_val: int,
        cmp_op: Any,
        async_op: bool = False,
        timeout: datetime.timedelta | float | None = None,
    ) -> CommWork | None:
        win, off = self._word(signal_disp)
        holds = _comparison(cmp_op)
        want = int(signal_val) & (2**64 - 1)
        limit = timeout_seconds(timeout) or self._engine.timeout
        deadline = time.monotonic() + limit if limit else None
        pause = 0.0
        while True:
            seen = win.fetch_add(self._engine.rank, off, 0)
            if holds(seen, want):
                return _completed(async_op)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"comm: signal word {signal_disp} is {seen}, and did not come to {cmp_op} {want} within {limit:g} s"
                )
            time.sleep(pause)
            pause = min(pause * 2 or 1e-6, 1e-3)

    def get_device_window(self, signal_count: int = -1, counter_count: int = -1, barrier_count: int = 1) -> int:
        raise NotImplementedError("comm: device windows are not supported (host memory only)")

    def register_local_buffer(self, tensor: torch.Tensor) -> int:
        raise NotImplementedError("comm: register_local_buffer is for device windows, which comm does not support")

    def deregister_local_buffer(self, handle: int) -> None:
        raise NotImplementedError("comm: register_local_buffer is for device windows, which comm does not support")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_COMPARISONS = {
    "EQ": operator.eq,
    "NE": operator.ne,
    "LT": operator.lt,
    "LE": operator.le,
    "GT": operator.gt,
    "GE": operator.ge,
}


def _comparison(cmp_op: Any):
    """The test a torchcomms SignalCmpOp (or its name, e.g. "GE" or "SIGNAL_CMP_GE") names."""
    name = getattr(cmp_op, "name", None) or str(cmp_op)
    key = name.rsplit(".", 1)[-1].rsplit("_", 1)[-1].upper()
    if key not in _COMPARISONS:
        raise ValueError(f"comm: unknown signal comparison {cmp_op!r}; EQ, NE, LT, LE, GT or GE")
    return _COMPARISONS[key]


def _completed(async_op: bool) -> CommWork | None:
    return CommWork(None, done=True) if async_op else None


class CommTorchCommsBackend(TorchCommBackend):
    """torchcomms backend over one libcomm communicator."""

    def __init__(self) -> None:
        super().__init__()
        self._engine = None
        self._device = None
        self._name = ""
        self._options = None

    # -- lifecycle
    def init(self, device: torch.device | str, name: str, options: Any) -> None:
        if self._engine is not None:
            raise RuntimeError(f"comm: communicator {name} is already initialized")
        rank, size = _rank_and_size()
        store = torch.distributed.PrefixStore(f"comm_torch/torchcomms/{name}/", _store(options))
        # The options' timeout bounds the init (new_comm's "timeout for initialization") and
        # every operation (CommOptions' "timeout for operations"), or COMM_TIMEOUT where shorter.
        timeout = timeout_seconds(getattr(options, "timeout", None))
        self._engine = Engine.from_store(store, rank, size, name, timeout=timeout)
        self._engine.set_timeout(operation_limit(timeout))
        self._device = torch.device(device)
        self._name = name
        self._options = options

    def finalize(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.destroy()

    def _abort_on_failure(self) -> bool:
        return bool(getattr(self._options, "abort_process_on_timeout_or_error", False))

    def _failed(self, error: BaseException) -> None:
        """abort_process_on_timeout_or_error: a timeout or a failed communication ends the
        process (SIGABRT), as torchcomms' NCCL backend does; other errors are raised."""
        if self._abort_on_failure() and getattr(error, "result", None) in _FATAL_RESULTS:
            sys.stderr.write(f"comm: aborting the process (abort_process_on_timeout_or_error): {error}\n")
            sys.stderr.flush()
            os.abort()

    def _check(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("comm: the communicator is not initialized, or was finalized")
        return self._engine

    def get_rank(self) -> int:
        return self._check().rank

    def get_size(self) -> int:
        return self._check().size

    def get_backend_name(self) -> str:
        return BACKEND_NAME

    def get_comm_name(self) -> str:
        return self._name

    @staticmethod
    def _done(work: CommWork, async_op: bool) -> CommWork | None:
        if async_op:
            return work
        work.wait()
        return None

    # -- point to point
    def send(self, tensor: torch.Tensor, dst: int, async_op: bool) -> CommWork | None:
        return self._done(self._check().send(tensor, dst, async_op), async_op)

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool) -> CommWork | None:
        return self._done(self._check().recv(tensor, src, async_op), async_op)

    # -- collectives
    def broadcast(self, tensor: torch.Tensor, root: int, async_op: bool) -> CommWork | None:
        return self._done(self._check().broadcast(tensor, root, async_op), async_op)

    def all_reduce(self, tensor: torch.Tensor, op: Any, async_op: bool) -> CommWork | None:
        if tensor.is_sparse:
            return self._done(self._check().sparse_all_reduce(tensor, reduction(op), async_op), async_op)
        return self._done(self._check().all_reduce(tensor, reduction(op), async_op), async_op)

    def reduce(self, tensor: torch.Tensor, root: int, op: Any, async_op: bool) -> CommWork | None:
        return self._done(self._check().reduce(tensor, root, reduction(op), async_op), async_op)

    def all_gather(self, tensor_list: Sequence[torch.Tensor], tensor: torch.Tensor, async_op: bool) -> CommWork | None:
        return self._done(self._check().all_gather(list(tensor_list), tensor, async_op), async_op)

    def all_gather_v(
        self, tensor_list: Sequence[torch.Tensor], tensor: torch.Tensor, async_op: bool
    ) -> CommWork | None:
        # all_gather takes a group of broadcasts when the sizes differ.
        return self._done(self._check().all_gather(list(tensor_list), tensor, async_op), async_op)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, async_op: bool) -> CommWork | None:
        return self._done(self._check().all_gather_single(output, input, async_op), async_op)

    def reduce_scatter(
        self, output: torch.Tensor, input_list: Sequence[torch.Tensor], op: Any, async_op: bool
    ) -> CommWork | None:
        return self._done(self._check().reduce_scatter(output, list(input_list), reduction(op), async_op), async_op)

    def reduce_scatter_v(
        self, output: torch.Tensor, input_list: Sequence[torch.Tensor], op: Any, async_op: bool
    ) -> CommWork | None:
        engine = self._check()
        inputs = list(input_list)
        if len(inputs) != engine.size:
            raise ValueError(f"comm: reduce_scatter_v needs one input per rank ({engine.size}), got {len(inputs)}")
        mine = inputs[engine.rank]
        if output.numel() != mine.numel() or any(t.dtype != output.dtype for t in inputs):
            raise ValueError(
                f"comm: reduce_scatter_v's output ({output.numel()} x {output.dtype}) must match this rank's "
                f"input block ({mine.numel()} x {mine.dtype}) and every input's dtype"
            )
        if all(t.numel() == output.numel() for t in inputs):
            return self.reduce_scatter(output, inputs, op, async_op)
        # Blocks of different sizes: one reduce per block, rooted at its owner, in a group.
        red = reduction(op)

        def build():
            for root, t in enumerate(inputs):
                buf = t.clone()  # ncclReduce runs in place; the caller's inputs stay intact
                if root == engine.rank:
                    engine._wrapped(lambda b=buf, r=root: engine.reduce(b, r, red), after=lambda b=buf: output.copy_(b))
                else:
                    engine.reduce(buf, root, red)

        return self._done(engine.group(build, [output], async_op), async_op)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, op: Any, async_op: bool
    ) -> CommWork | None:
        return self._done(self._check().reduce_scatter_single(output, input, reduction(op), async_op), async_op)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, async_op: bool) -> CommWork | None:
        return self._done(self._check().all_to_all_single(output, input, None, None, async_op), async_op)

    def all_to_all_v_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        async_op: bool,
    ) -> CommWork | None:
        engine = self._check()
        outs, ins = [int(s) for s in output_split_sizes], [int(s) for s in input_split_sizes]
        # As torchcomms' NCCL backend: the splits may cover less than the first dimension (the
        # rest is left alone), not more.
        for what, t, splits in (("input", input, ins), ("output", output, outs)):
            rows = t.shape[0] if t.dim() else 1
            if sum(splits) > rows:
                raise ValueError(f"comm: {what} split sizes {splits} add up to more than its {rows} rows")
            if t.dim() and sum(splits) < rows and len(splits) == engine.size:
                if what == "input":
                    input = t.narrow(0, 0, sum(splits))
                else:
                    output = t.narrow(0, 0, sum(splits))
        return self._done(engine.all_to_all_single(output, input, outs, ins, async_op), async_op)

    def all_to_all(
        self, output_tensor_list: Sequence[torch.Tensor], input_tensor_list: Sequence[torch.Tensor], async_op: bool
    ) -> CommWork | None:
        return self._done(
            self._check().all_to_all(list(output_tensor_list), list(input_tensor_list), async_op), async_op
        )

    def barrier(self, async_op: bool) -> CommWork | None:
        # torchcomms options carry the communicator's timeout; a barrier honours it.
        timeout = getattr(self._options, "timeout", None)
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        timeout = float(timeout) if isinstance(timeout, (int, float)) and timeout > 0 else None
        return self._done(self._check().barrier(async_op, timeout), async_op)

    def scatter(
        self, output_tensor: torch.Tensor, input_tensor_list: Sequence[torch.Tensor], root: int, async_op: bool
    ) -> CommWork | None:
        return self._done(self._check().scatter(output_tensor, list(input_tensor_list), root, async_op), async_op)

    def gather(
        self, output_tensor_list: Sequence[torch.Tensor], input_tensor: torch.Tensor, root: int, async_op: bool
    ) -> CommWork | None:
        return self._done(self._check().gather(list(output_tensor_list), input_tensor, root, async_op), async_op)

    # -- sub-communicators
    def split(self, ranks: Sequence[int], name: str, options: Any) -> CommTorchCommsBackend | None:
        """ncclCommSplit: ``ranks`` are this rank's new group (every caller lists its own);
        an empty list takes part without joining any group and returns None."""
        engine = self._check()
        ranks = [int(r) for r in ranks]
        if len(set(ranks)) != len(ranks) or any(not 0 <= r < engine.size for r in ranks):
            raise RuntimeError(f"comm: invalid split ranks {ranks} for a communicator of {engine.size}")
        if not ranks:
            engine.split(-1, 0, name)
            return None
        if engine.rank not in ranks:
            raise RuntimeError(f"comm: rank {engine.rank} is not in the split ranks {ranks}")
        child = CommTorchCommsBackend()
        child._engine = engine.split(min(ranks), ranks.index(engine.rank), name)
        child._engine.set_timeout(operation_limit(timeout_seconds(getattr(options, "timeout", None))))
        child._device = self._device
        child._name = name
        child._options = options
        # The C++ base keeps the device and options that init() would have recorded.
        set_device = getattr(child, "_set_device_and_options", None)
        if set_device is not None:
            set_device(self._device, options)
        return child

    # -- windows
    def new_window(self, tensor: torch.Tensor | None = None) -> CommWindow:
        """A window of this communicator; registers ``tensor`` (collective) when given."""
        return CommWindow(self._check(), tensor)

    def window_allocate(self, window_size: int, cpu_buf: bool = True, signal_size: int = 256) -> CommWindow:
        """Collective: a window over ``window_size`` bytes of shared host memory (zero-filled),
        so that ``map_remote_tensor`` reaches peers on this host, with ``signal_size`` signal
        words for the seed API's signal and wait_signal. (The removed torchcomms ``allocate``.)"""
        from ._window import Allocation

        _, raw = Allocation.create(window_size)
        return CommWindow(self._check(), raw, signal_size)


# Results after which torchcomms' abort_process_on_timeout_or_error ends the process: a
# timeout or a failure of the communication, not a call refused for its arguments.
_FATAL_RESULTS = (2, 3, 6, _lib.RESULT_TIMEOUT)  # system, internal, remote, timeout

_OPERATIONS = (
    "send",
    "recv",
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_v",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_v",
    "reduce_scatter_single",
    "all_to_all_single",
    "all_to_all_v_single",
    "all_to_all",
    "barrier",
    "scatter",
    "gather",
)


def _aborting(method):
    """``method`` of the backend, ending the process on a fatal failure when the options ask
    for it (abort_process_on_timeout_or_error), whether it fails at once or at ``wait()``."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        try:
            work = method(self, *args, **kwargs)
        except CommError as e:
            self._failed(e)
            raise
        if work is not None and self._abort_on_failure():
            work._on_failure = self._failed
        return work

    return run


for _name in _OPERATIONS:
    setattr(CommTorchCommsBackend, _name, _aborting(getattr(CommTorchCommsBackend, _name)))

if not _is_backend_registered(BACKEND_NAME):
    register_backend(BACKEND_NAME, CommTorchCommsBackend)
