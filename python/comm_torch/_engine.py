"""The engine shared by the torch.distributed and torchcomms backends.

``Engine`` owns one libcomm communicator and turns tensor operations into library calls:
each torch operation becomes one library call, or one ncclGroupStart/ncclGroupEnd group, run
by the communicator's executor (``_work.Executor``). The operations themselves are in
``_collectives``; this module holds the communicator's life, how an operation's calls become
a task (``_issue``), coalescing and groups, point-to-point calls deferred until needed, and
reductions.

On host memory a libcomm call is complete when it returns. Device (CUDA) tensors follow
NCCL's stream semantics: the call is enqueued on a communication stream that first waits for
the caller's current stream, and ``wait()`` makes the caller's stream wait for it. libcomm
reports its device path through ``commGetFeatures`` (COMM_FEATURE_DEVICE_MEMORY: a CUDA driver
and a GPU were found); where it does not, CUDA tensors are refused with an error that says so.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import threading
import time

import torch

from . import _lib
from ._collectives import Collectives
from ._lib import CommError
from ._types import _DTYPES, _OPS
from ._work import CommWork, Executor, Task, _deferred_here, _joined, _under, completed_work, flush_deferred_p2p

_byref = ctypes.byref


def timeout_seconds(value: datetime.timedelta | float | None) -> float | None:
    """Seconds of a torch timeout (timedelta or number); None when unset (torch's unset timeout
    is -1 ms, kUnsetTimeout)."""
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else float(value)
    return None if seconds < 0 else seconds


def operation_limit(group_timeout: float | None) -> float:
    """How long the group's operations may wait without progress (commSetTimeout; 0: no
    limit): the group's timeout, as gloo applies it to every operation, or COMM_TIMEOUT where
    that is set and shorter."""
    try:
        env = float(os.environ.get("COMM_TIMEOUT", "") or 0)
    except ValueError:
        env = 0.0
    limits = [t for t in (group_timeout, env) if t is not None and t > 0]
    return min(limits) if limits else 0.0


def _exchange_unique_id(lib, store, rank, key):
    if rank == 0:
        uid = _lib.UniqueId()
        lib.check(lib.ncclGetUniqueId(_byref(uid)), "ncclGetUniqueId")
        store.set(key, bytes(uid))
        return uid
    raw = store.get(key)
    if len(raw) != _lib.UNIQUE_ID_BYTES:
        raise CommError(f"comm: the unique id under store key {key!r} has {len(raw)} bytes, expected 128")
    return _lib.UniqueId.from_buffer_copy(raw)


class Engine(Collectives):
    """One libcomm communicator and the operations on it (those in ``Collectives``)."""

    def __init__(self, lib, handle, rank, size, name):
        self.lib = lib
        self.handle = ctypes.c_void_p(handle)
        self.rank = rank
        self.size = size
        self.name = name
        self.executor = Executor(name)
        self._all_reduce = lib.ncclAllReduce
        self._coalescing = None
        self._streams = {}
        self._features = None
        self._destroyed = False
        self.origin = "init"  # or "split": how the communicator was made
        self._p2p = []  # deferred (task, work) of point-to-point calls, see _dispatch
        self._anys = []  # deferred (task, work) of receives from any source, see recv_any_source
        self.timeout = operation_limit(None)  # seconds without progress (0: none), see set_timeout
        self._p2p_lock = threading.Lock()
        # The engine that carries this one's sends and receives, when they have a
        # communicator of their own (see separate_p2p); None: this one carries them.
        self._p2p_side = None

    # -- creation
    @classmethod
    def from_store(cls, store, rank, size, name, key="comm_torch/unique_id", timeout=None):
        """Creates the communicator of ``size`` ranks; rank 0's unique id travels through the
        c10d ``store`` under ``key`` (the store is prefixed per process group by torch).
        ``timeout`` (seconds): the init fails with TimeoutError when the ranks have not all
        come by then (without it, COMM_INIT_TIMEOUT bounds it)."""
        lib = _lib.load_library()
        uid = _exchange_unique_id(lib, store, rank, key)
        handle = ctypes.c_void_p()
        config = _lib.Config.new(name)
        if timeout is None or timeout <= 0:
            lib.check(
                lib.ncclCommInitRankConfig(_byref(handle), size, uid, rank, _byref(config)),
                "ncclCommInitRankConfig",
            )
        else:
            # Non-blocking, so that the wait can be bounded here and the init abandoned.
            config.blocking = 0
            r = lib.ncclCommInitRankConfig(_byref(handle), size, uid, rank, _byref(config))
            if r != _lib.IN_PROGRESS:
                lib.check(r, "ncclCommInitRankConfig")
            deadline = time.monotonic() + timeout
            state = ctypes.c_int(_lib.IN_PROGRESS)
            while True:
                lib.check(lib.ncclCommGetAsyncError(handle, _byref(state)), "ncclCommGetAsyncError", handle)
                if state.value != _lib.IN_PROGRESS:
                    break
                if time.monotonic() >= deadline:
                    lib.ncclCommAbort(handle)
                    raise TimeoutError(
                        f"comm: communicator {name!r} of {size} ranks was not initialized within "
                        f"{timeout:g} s: some rank has not come (rank {rank} waited)"
                    )
                time.sleep(0.001)
            if state.value != 0:
                lib.check(state.value, "ncclCommInitRankConfig", handle)
            # Non-blocking was for the init alone: operations complete before they return.
            lib.check(lib.commSetBlocking(handle, 1), "commSetBlocking", handle)
        if rank == 0:
            # Every rank has read the id once the init returns here; a later group created
            # under the same prefix (a re-initialized world on a long-lived store) must not
            # find it.
            try:
                store.delete_key(key)
            except Exception:  # noqa: BLE001, S110  not every store can delete; a stale id is harmless
                pass
        return cls(lib, handle.value, rank, size, name)

    def split(self, color, key, name):
        """ncclCommSplit, collective over this communicator; None for NCCL_SPLIT_NOCOLOR."""

        def do_split():
            child = ctypes.c_void_p()
            config = _lib.Config.new(name)
            self._check(
                self.lib.ncclCommSplit(self.handle, color, key, _byref(child), _byref(config)),
                "ncclCommSplit",
            )
            return child.value

        self.flush_p2p()
        child = self.executor.call(do_split)
        if color == _lib.SPLIT_NOCOLOR or not child:
            return None
        count, rank = ctypes.c_int(), ctypes.c_int()
        self.lib.check(self.lib.ncclCommCount(child, _byref(count)), "ncclCommCount", child)
        self.lib.check(self.lib.ncclCommUserRank(child, _byref(rank)), "ncclCommUserRank", child)
        engine = type(self)(self.lib, child, rank.value, count.value, name)
        engine.origin = "split"
        return engine

    def separate_p2p(self):
        """Gives this engine's sends and receives a communicator of their own, split from
        this one: collective over its ranks, so called where they all create it.

        A channel between two ranks delivers in order, so on one communicator a collective
        cannot start while a receive from any source waits on the executor (its sender may
        first be in the same collective: rank 0 posts irecv(src=None) and all-reduces, rank 1
        all-reduces and then sends); the collective waited behind the receive for good. On a
        communicator of their own, point-to-point calls and collectives proceed
        independently, as gloo keeps them apart by tags."""
        if self._p2p_side is None:
            side = self.split(0, self.rank, f"{self.name}:p2p")
            if self.timeout:
                side.set_timeout(self.timeout)
            self._p2p_side = side

    def destroy(self):
        if self._destroyed:
            return
        self._destroyed = True

        def do_destroy():
            self._check(self.lib.ncclCommDestroy(self.handle), "ncclCommDestroy")

        try:
            self.flush_p2p()
            if self._p2p_side is not None:
                self._p2p_side.destroy()
            self.executor.call(do_destroy)
        finally:
            self.executor.close()

    def abort(self):
        """ncclCommAbort from any thread: unblocks a call stuck on a dead peer."""
        if self._destroyed:
            return
        self._destroyed = True
        if self._p2p_side is not None:
            self._p2p_side.abort()
        self.lib.ncclCommAbort(self.handle)
        self.executor.close(drain=False)

    def _check(self, result, call):
        if result:
            self.lib.check(result, call, self.handle)

    # -- features and devices
    def features(self):
        if self._features is None:
            self._features = self.lib.features()
        return self._features

    def _cuda_context(self, tensors, keep=()):
        """None for host tensors; (device, stream, start event) for CUDA tensors, after the
        checks: the library must report device memory, and one device per operation."""
        device = None
        for t in tensors:
            if t.device.type != "cpu":
                device = t.device
                break
        if device is None:
            return None
        if device.type != "cuda":
            raise RuntimeError(f"comm: tensors on {device} are not supported (cpu and cuda only)")
        if not self.features() & _lib.FEATURE_DEVICE_MEMORY:
            raise RuntimeError(
                "comm: CUDA tensors are not supported by this libcomm build: commGetFeatures does "
                "not report COMM_FEATURE_DEVICE_MEMORY (the library's GPU path, or a CUDA driver, "
                "is missing). Use CPU tensors, or backend='cpu:comm,cuda:nccl'."
            )
        for t in tensors:
            if t.device != device:
                raise RuntimeError(f"comm: tensors of one operation must be on one device, got {device} and {t.device}")
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        start = torch.cuda.Event()
        start.record(torch.cuda.current_stream(device))
        for t in list(tensors) + [k for k in keep if isinstance(k, torch.Tensor) and k.is_cuda]:
            # The caching allocator must not hand this memory out again before the
            # communication stream is done with it.
            t.record_stream(stream)
        return (device, stream, start)

    # -- running tasks
    def _issue(
        self,
        call,
        args,
        tensors,
        finish=None,
        cleanup=None,
        result=None,
        async_op=False,
        keep=(),
        before=None,
        p2p=False,
        alone=False,
    ):
        """One library call as an operation: ``lib.<call>(*args, comm, stream)``, its result
        checked, wrapped in a Task and run (or recorded while coalescing). ``args`` is a
        tuple, or a function that gives it when the call is made (a PreMulSum op is created
        then); ``before`` runs first, inside the task (packing inputs). ``keep`` lists the
        buffers the call points into besides ``tensors``."""
        lib, handle = self.lib, self.handle
        fn = getattr(lib, call)
        cuda = self._cuda_context(tensors, keep)
        stream = None if cuda is None else cuda[1].cuda_stream

        def issue():
            if before is not None:
                before()
            r = fn(*(args() if callable(args) else args), handle, stream)
            if r:
                lib.check(r, call, handle)

        task = Task(issue, finish, cleanup, result, cuda, (tensors, keep))
        return self._dispatch(task, async_op, p2p, alone)

    def _dispatch(self, task, async_op, p2p=False, alone=False):
        """Runs ``task``, records it while coalescing, or, for a point-to-point call (``p2p``),
        defers it (see below); ``alone``: a point-to-point call that cannot join the group of
        the others and runs after it (a receive from any source)."""
        if self._coalescing is not None:
            self._coalescing.append(task)
            # Valid once the work of end_coalescing completes, as with NCCL.
            return completed_work(task.result)
        if p2p:
            # Sends and receives wait until something needs them (a wait on one of them,
            # or any other operation), then start together as one group. So, as with gloo,
            # isend and irecv may be posted in any order: an irecv posted before the matching
            # send cannot block the send behind it.
            work = CommWork(task.result)
            work._flush = flush_deferred_p2p
            with self._p2p_lock:
                (self._anys if alone else self._p2p).append((task, work))
            _deferred_here().add(self)
            if not async_op:
                work.wait()
            return work
        flush_deferred_p2p()
        if self._p2p or self._anys:
            self.flush_p2p()
        return self.executor.run(task, async_op)

    def set_timeout(self, seconds: float) -> None:
        """commSetTimeout: this communicator's operations fail with ncclTimeout after
        ``seconds`` without progress (0: no limit)."""
        self.lib.check(self.lib.commSetTimeout(self.handle, float(seconds)), "commSetTimeout", self.handle)
        self.timeout = float(seconds)
        if self._p2p_side is not None:
            self._p2p_side.set_timeout(seconds)

    def flush_p2p(self):
        """Starts the deferred point-to-point calls, as one group."""
        if self._p2p_side is not None:
            self._p2p_side.flush_p2p()
        with self._p2p_lock:
            pending, self._p2p = self._p2p, []
            anys, self._anys = self._anys, []
        _deferred_here().discard(self)
        if pending:
            self._run_group([t for t, _ in pending], None, True, children=[w for _, w in pending])
        # Receives from any source each run alone (their source is chosen when they run),
        # after the group: a send posted after one of them must not wait behind it.
        for task, work in anys:
            alone = Task(task.issue, task.finish, task.cleanup, task.result, task.cuda, task.keep)
            alone.children = (work,)
            alone.state = task.state
            self.executor.run(alone, True)

    def _capture(self, make_op):
        """The Task that ``make_op()`` builds, without running it."""
        outer = self._coalescing
        self._coalescing = []
        try:
            make_op()
            tasks = self._coalescing
        finally:
            self._coalescing = outer
        return tasks

    def _wrapped(self, make_op, before=None, after=None, result=None, async_op=False):
        """Runs the single operation ``make_op`` builds with host-side steps around it, all
        in one task: ``before`` packs inputs, ``after`` copies outputs out."""
        (inner,) = self._capture(make_op)

        def issue():
            if before is not None:
                before()
            inner.issue()

        def finish():
            if inner.finish is not None:
                inner.finish()
            if after is not None:
                after()

        task = Task(issue, finish, inner.cleanup, result, inner.cuda, inner.keep)
        return self._dispatch(task, async_op)

    def start_coalescing(self):
        self.flush_p2p()
        if self._coalescing is not None:
            raise RuntimeError("comm: start_coalescing called twice without end_coalescing")
        self._coalescing = []
        if self._p2p_side is not None:
            self._p2p_side.start_coalescing()

    def end_coalescing(self, async_op=True):
        tasks, self._coalescing = self._coalescing, None
        if tasks is None:
            raise RuntimeError("comm: end_coalescing without start_coalescing")
        side = self._p2p_side
        if side is None:
            return self._run_group(tasks, [t.result for t in tasks], async_op)
        sends, side._coalescing = side._coalescing or [], None
        if not sends:
            return self._run_group(tasks, [t.result for t in tasks], async_op)
        if not tasks:
            return side._run_group(sends, [t.result for t in sends], async_op)
        # Sends and receives coalesced with collectives: one group on each communicator, the
        # work complete when both are.
        result = [t.result for t in sends + tasks]
        work = _joined([side._run_group(sends, None, True), self._run_group(tasks, None, True)], result)
        if not async_op:
            work.wait()
        return work

    def group(self, build, result=None, async_op=False):
        """Runs every operation ``build()`` issues on this engine as one library group."""
        tasks = self._capture(build)
        if self._coalescing is not None:
            self._coalescing.extend(tasks)
            return completed_work(result)
        return self._run_group(tasks, result, async_op)

    def _run_group(self, tasks, result, async_op, children=()):
        if not tasks:
            return completed_work(result)
        lib, handle = self.lib, self.handle
        cuda = next((t.cuda for t in tasks if t.cuda is not None), None)

        # Each task's steps run under its own issuer's modes: deferred point-to-point calls
        # posted under different modes end up in one group.
        def issue():
            lib.check(lib.ncclGroupStart(), "ncclGroupStart")
            try:
                for t in tasks:
                    _under(t.state, t.issue)
            finally:
                lib.check(lib.ncclGroupEnd(), "ncclGroupEnd", handle)

        def finish():
            for t in tasks:
                if t.finish is not None:
                    _under(t.state, t.finish)

        def cleanup():
            for t in tasks:
                if t.cleanup is not None:
                    _under(t.state, t.cleanup)

        group = Task(issue, finish, cleanup, result, cuda, [t.keep for t in tasks])
        group.children = children
        return self.executor.run(group, async_op)

    # -- reductions
    def _reduction(self, dtype, op):
        """(real view needed, ncclDataType_t, op code or None for PreMulSum) of ``op`` on
        tensors of ``dtype``."""
        kind = op.kind
        as_real = False
        if dtype.is_complex:
            if kind not in ("sum", "avg", "premul_sum"):
                raise RuntimeError(f"comm: {kind} is not defined on complex tensors")
            as_real = True
            dtype = torch.view_as_real(torch.empty(0, dtype=dtype)).dtype
        if dtype == torch.bool:
            # As ProcessGroupNCCL does: a sum of booleans is a logical or, a product a logical and.
            bool_ops = {
                "sum": "max",
                "product": "min",
                "max": "max",
                "min": "min",
                "band": "band",
                "bor": "bor",
                "bxor": "bxor",
            }
            if kind not in bool_ops:
                raise RuntimeError(f"comm: {kind} is not defined on bool tensors")
            kind = bool_ops[kind]
            code = _lib.UINT8
        else:
            code = _DTYPES.get(dtype)
            if code is None:
                raise RuntimeError(f"comm: reductions are not supported for dtype {dtype}")
        return as_real, code, (None if kind == "premul_sum" else _OPS[kind])

    def _reducer(self, dtype, op):
        """Returns (opcode_fn, cleanup, as_real, code): ``opcode_fn()`` gives the op to pass,
        creating a PreMulSum op on first use; ``cleanup`` destroys it after the call."""
        as_real, code, opcode = self._reduction(dtype, op)
        if opcode is not None:
            return (lambda: opcode), None, as_real, code
        real_dtype = torch.view_as_real(torch.empty(0, dtype=dtype)).dtype if as_real else dtype
        made = []
        lib, handle = self.lib, self.handle

        def create():
            factor = op.factor
            if isinstance(factor, torch.Tensor):
                scalar = factor.detach().reshape(1).to(real_dtype).contiguous()
                residence = _lib.SCALAR_HOST_IMMEDIATE if scalar.device.type == "cpu" else _lib.SCALAR_DEVICE
            else:
                scalar = torch.tensor([float(factor)], dtype=real_dtype)
                residence = _lib.SCALAR_HOST_IMMEDIATE
            out = ctypes.c_int()
            self._check(
                lib.ncclRedOpCreatePreMulSum(_byref(out), scalar.data_ptr(), code, residence, handle),
                "ncclRedOpCreatePreMulSum",
            )
            made.append((out.value, scalar))
            return out.value

        def cleanup():
            while made:
                lib.ncclRedOpDestroy(made.pop()[0], handle)

        return create, cleanup, as_real, code

    # -- helpers
    @staticmethod
    def _movable(t):
        """(ncclDataType_t, count) that moves tensor ``t`` unchanged."""
        code = _DTYPES.get(t.dtype)
        if code is not None:
            return code, t.numel()
        return _lib.UINT8, t.numel() * t.element_size()

    @staticmethod
    def _dense(t):
        """A contiguous buffer for ``t``, and whether it is a staging copy."""
        if t.is_contiguous():
            return t, False
        return t.contiguous(), True

    def _peer(self, rank, what):
        if not 0 <= rank < self.size:
            raise RuntimeError(f"comm: {what} {rank} is out of range for a group of {self.size} ranks")
        return rank

    def _copy_back(self, staged, dst, src):
        return (lambda: dst.copy_(src)) if staged else None
