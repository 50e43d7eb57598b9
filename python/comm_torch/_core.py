"""The engine shared by the torch.distributed and torchcomms backends.

``Engine`` owns one libcomm communicator and turns tensor operations into library calls:
each torch operation becomes one library call, or one ncclGroupStart/ncclGroupEnd group, run
by the communicator's executor. The executor keeps every call on a communicator in issue
order: a synchronous call with nothing in flight runs inline in the caller's thread (the
fast path for small messages); anything else goes to a worker thread, so ``async_op=True``
returns before the data moves. ctypes releases the GIL while libcomm runs, so the caller's
Python thread keeps going.

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
import queue
import threading
import time
import weakref
from typing import Any

import torch

from . import _lib
from ._lib import CommError

_byref = ctypes.byref


def _dtype_table():
    table = {
        torch.int8: _lib.INT8,
        torch.uint8: _lib.UINT8,
        torch.int32: _lib.INT32,
        torch.int64: _lib.INT64,
        torch.float16: _lib.FLOAT16,
        torch.float32: _lib.FLOAT32,
        torch.float64: _lib.FLOAT64,
        torch.bfloat16: _lib.BFLOAT16,
    }
    for name, code in (
        ("uint32", _lib.UINT32),
        ("uint64", _lib.UINT64),
        ("float8_e4m3fn", _lib.FLOAT8E4M3),
        ("float8_e5m2", _lib.FLOAT8E5M2),
    ):
        dtype = getattr(torch, name, None)
        if dtype is not None:
            table[dtype] = code
    return table


_DTYPES = _dtype_table()

_OPS = {
    "sum": _lib.OP_SUM,
    "product": _lib.OP_PROD,
    "max": _lib.OP_MAX,
    "min": _lib.OP_MIN,
    "avg": _lib.OP_AVG,
    "band": _lib.OP_BAND,
    "bor": _lib.OP_BOR,
    "bxor": _lib.OP_BXOR,
}


class Reduction:
    """A reduction as the engine sees it: ``kind`` is one of the _OPS names or "premul_sum"."""

    __slots__ = ("factor", "kind")

    def __init__(self, kind: str, factor: float | torch.Tensor | None = None) -> None:
        self.kind = kind
        self.factor = factor

    def __repr__(self):
        return f"Reduction({self.kind!r})" if self.factor is None else f"Reduction(premul_sum, {self.factor})"


SUM = Reduction("sum")


# ----------------------------------------------------------------------------------------
# Work: what an operation returns.


def _seconds(timeout):
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    # torch passes kNoTimeout (0 ms) when the caller gave none.
    return None if timeout <= 0 else float(timeout)


try:
    from torch.distributed import Work as _WorkBase
except Exception:  # noqa: BLE001  # pragma: no cover - torch without distributed
    _WorkBase = object


_FINISHED_LOCK = threading.Lock()


class CommWork(_WorkBase):
    """Completion of one operation (or one coalesced group of them).

    A subclass of torch.distributed.Work, so torch's PyWork trampoline forwards ``wait`` and
    ``get_future`` here (torch/csrc/distributed/c10d/PyProcessGroup.hpp). ``wait`` raises the
    library's error as CommError.

    ``get_future`` returns a future chained with ``then`` from an internal one: a Python
    ``Future.set_exception`` only marks the Python wrapper (torch/futures/__init__.py sets an
    unwrap function), so a consumer in C++ such as DDP's reducer would see the exception as a
    value; an exception raised inside a ``then`` callback fails the C++ future itself.
    """

    # What most works never change is a class attribute: a synchronous call makes one finished
    # work (its future holds the outputs), and that is on the path of every small operation.
    _base = None
    _future = None
    _end_event = None  # CUDA event recorded after a device operation
    _device = None
    _flush = None  # for deferred point-to-point work: starts it (Engine.flush_p2p)
    # An operation with a deadline (a barrier under the group's timeout): past it, wait()
    # raises what ``_expire()`` returns (Engine.barrier).
    _deadline = None
    _expire = None
    _source = None  # for a receive from any source: a ctypes int the call fills in
    _on_failure = None  # called with the error before wait() raises it

    def __init__(self, result: Any = None, done: bool = False, error: BaseException | None = None) -> None:
        if _WorkBase is not object:
            _WorkBase.__init__(self)
        self._result = result
        self._error = error
        self._done = done
        self._event = None if done else threading.Event()
        # Guards the making of the future; finished works, which nothing completes, share one.
        self._lock = _FINISHED_LOCK if done else threading.Lock()

    # -- completion (executor side)
    def _complete(self, error=None):
        """Marks the work done. Returns the torch future to complete, if one was asked for:
        the executor completes it once it no longer holds the communicator, since completing
        it runs the callbacks chained to it, which may issue operations (Executor._loop)."""
        self._error = error
        with self._lock:
            self._done = True
            base = self._base
            event = self._event
        if event is not None:
            event.set()
        return base

    # -- torch.distributed.Work interface
    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        if self._flush is not None:
            self._flush()
        if not self._done:
            limit = _seconds(timeout)
            if self._deadline is not None:
                left = max(0.0, self._deadline - time.monotonic())
                limit = left if limit is None else min(limit, left)
            if not self._event.wait(limit):
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    raise self._expire()
                raise CommError(f"comm: operation did not complete within {timeout}", call="wait")
        if self._error is not None:
            if self._on_failure is not None:
                self._on_failure(self._error)
            raise self._error
        if self._end_event is not None:
            # Device work: the caller's stream waits for the communication stream.
            torch.cuda.current_stream(self._device).wait_event(self._end_event)
        return True

    def is_completed(self) -> bool:
        if self._flush is not None:
            self._flush()
        if not self._done:
            return False
        if self._end_event is not None and self._error is None:
            return self._end_event.query()
        return True

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> Any:
        return self._result

    def source_rank(self) -> int:
        """The rank a receive from any source took its message from (after wait())."""
        if self._source is None:
            raise RuntimeError("comm: source_rank is only defined for a receive from any source")
        self.wait()
        return self._source.value

    _source_rank = source_rank

    def synchronize(self) -> None:
        self.wait()

    def _unwrap(self, _fut):
        if self._error is not None:
            raise self._error
        return self._result

    def get_future(self) -> torch.futures.Future:
        if self._flush is not None:
            self._flush()
        with self._lock:
            if self._future is None:
                self._base = torch.futures.Future()
                self._future = self._base.then(self._unwrap)
                ready = self._done
            else:
                ready = False
        if ready:
            self._base.set_result(None)
        return self._future


def completed_work(result=None):
    return CommWork(result, done=True)


def _joined(works, result):
    """One work for several: complete when all of them are, failed with the first error."""
    joined = CommWork(result)
    lock = threading.Lock()
    left = [len(works)]
    errors = []

    def one_done(fut):
        try:
            fut.value()
        except Exception as err:  # noqa: BLE001  handed to the joined work's wait()
            errors.append(err)
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            base = joined._complete(errors[0] if errors else None)
            if base is not None:
                base.set_result(None)

    for w in works:
        w.get_future().add_done_callback(one_done)
    return joined


# ----------------------------------------------------------------------------------------
# Tasks and the executor.


def _thread_state():
    """The autograd modes torch keeps per thread, (inference mode, grad mode), as a task
    takes them from the thread that issues it (see _under)."""
    return (torch.is_inference_mode_enabled(), torch.is_grad_enabled())


def _under(state, fn):
    """``fn()`` under the autograd modes ``state`` of the thread that issued the operation,
    wherever it runs, as gloo runs its work under the issuer's thread-local state. On the
    executor's thread it ran under that thread's own modes: copying an output into an
    inference tensor failed there ("Inplace update to inference tensor outside
    InferenceMode"), and so did one into a leaf that requires grad under the caller's
    no_grad."""
    if state == _thread_state():
        return fn()
    with torch.inference_mode(state[0]), torch.set_grad_enabled(state[1]):
        return fn()


class Task:
    """Library calls for one torch operation. ``issue`` makes the calls (possibly inside an
    enclosing group); ``finish`` runs after the group ended successfully (copy-outs);
    ``cleanup`` runs after the group in any case (reduction ops to destroy)."""

    __slots__ = ("children", "cleanup", "cuda", "finish", "issue", "keep", "result", "state", "work")

    def __init__(self, issue, finish=None, cleanup=None, result=None, cuda=None, keep=None):
        self.issue = issue
        self.finish = finish
        self.cleanup = cleanup
        self.result = result
        self.cuda = cuda  # (device, stream, start event) for device tensors
        self.work = None
        # The calls take raw pointers: every tensor they point into stays referenced here
        # until the task has run.
        self.keep = keep
        self.children = ()  # works of deferred point-to-point calls this group task runs
        self.state = _thread_state()  # the issuing thread's modes, see _under

    def run(self):
        """Runs the calls in this thread (see _under); raises the first error. Returns the
        CUDA end event for device work, else None."""
        return _under(self.state, self._run)

    def _run(self):
        try:
            if self.cuda is None:
                self.issue()
                if self.finish is not None:
                    self.finish()
                return None
            _device, stream, start = self.cuda
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                self.issue()
                if self.finish is not None:
                    self.finish()
                end = torch.cuda.Event()
                end.record(stream)
            return end
        finally:
            if self.cleanup is not None:
                self.cleanup()

    def execute(self):
        """Runs the calls and completes ``self.work`` (the worker thread's side)."""
        error = None
        try:
            end = self.run()
            if end is not None:
                self.work._end_event = end
                self.work._device = self.cuda[0]
        except BaseException as err:  # noqa: BLE001  surfaced through wait(), never lost in the worker
            error = err if isinstance(err, Exception) else CommError(f"comm: {err!r}")
        futures = [self.work._complete(error)]
        futures.extend(child._complete(error) for child in self.children)
        return [f for f in futures if f is not None]


# What a synchronous operation that already ran inline returns: torch only waits on it.
DONE = CommWork(None, done=True)

_STOP = object()


class Executor:
    """Runs one communicator's tasks in issue order (see the module docstring)."""

    def __init__(self, name):
        self._name = name
        self._lock = threading.Lock()
        self._exec = threading.Lock()  # held while libcomm runs a task
        self._pending = 0
        self._queue = queue.SimpleQueue()
        self._thread = None
        self._closed = False

    def enter_inline(self):
        """True, holding the right to call libcomm in this thread now, when nothing is in
        flight; the caller must call ``exit_inline``. False otherwise."""
        with self._lock:
            if self._closed:
                raise CommError(f"comm: communicator {self._name} was shut down", call="run")
            if self._pending or threading.current_thread() is self._thread:
                return False
            self._pending = 1
            self._exec.acquire()
        return True

    def exit_inline(self):
        self._exec.release()
        with self._lock:
            self._pending -= 1

    def run(self, task, async_op):
        if threading.current_thread() is self._thread:
            return self._run_from_callback(task)
        if not async_op and self.enter_inline():
            try:
                end = task.run()
            finally:
                self.exit_inline()
            if end is None:
                # The future of a finished operation still holds its outputs, as gloo's does.
                return DONE if task.result is None else CommWork(task.result, done=True)
            work = CommWork(task.result, done=True)
            work._end_event, work._device = end, task.cuda[0]
            return work
        return self._enqueue(task)

    def _enqueue(self, task):
        """Queues ``task`` for the executor's thread (started the first time) and returns its work."""
        task.work = CommWork(task.result)
        with self._lock:
            if self._closed:
                raise CommError(f"comm: communicator {self._name} was shut down", call="run")
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"comm-torch:{self._name}", daemon=True)
                self._thread.start()
            self._queue.put(task)
        return task.work

    def call(self, fn):
        """Runs ``fn`` in issue order with the other tasks and returns its result (splits and
        destruction are collective over the communicator, so they queue like operations)."""
        out = {}

        def issue():
            out["value"] = fn()

        self.run(Task(issue), async_op=False).wait()
        return out.get("value")

    def _loop(self):
        while True:
            task = self._queue.get()
            if task is _STOP:
                return
            self._execute(task)

    def _execute(self, task):
        with self._exec:
            futures = task.execute()
        with self._lock:
            self._pending -= 1
        # Callbacks chained to the futures run here, in this thread, and may issue operations
        # on this communicator (DDP's PowerSGD hook all-reduces from one): they run through
        # _run_from_callback.
        for f in futures:
            f.set_result(None)

    def _run_from_callback(self, task):
        """An operation issued by a callback that runs in this executor's thread (a future's
        `then`): it queues behind what was issued before it, and this thread runs the queue up
        to it before returning, since no other thread would (waiting for it here hung)."""
        work = self._enqueue(task)
        while not work._done:
            queued = self._queue.get()
            if queued is _STOP:
                self._queue.put(_STOP)
                raise CommError(f"comm: communicator {self._name} was shut down", call="run")
            self._execute(queued)
        return work

    def close(self, drain=True):
        with self._lock:
            self._closed = True
            thread = self._thread
            if thread is not None:
                self._queue.put(_STOP)
        if thread is not None and drain and thread is not threading.current_thread():
            thread.join()


# ----------------------------------------------------------------------------------------
# The communicator.

# Per thread: the engines holding point-to-point calls this thread deferred (Engine._dispatch).
_deferred = threading.local()


def _deferred_here() -> weakref.WeakSet:
    engines = getattr(_deferred, "engines", None)
    if engines is None:
        engines = _deferred.engines = weakref.WeakSet()
    return engines


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


def flush_deferred_p2p() -> None:
    """Starts the point-to-point calls this thread deferred, on every communicator: an
    operation on one group must not leave an isend on another unsent (rank 0 isends on the
    world, then all-reduces on a subgroup while rank 1 receives on the world first: that
    deadlocked, the send waiting for a wait or another operation on the world)."""
    for engine in list(_deferred_here()):
        engine.flush_p2p()


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


def _pack(tensors, flat):
    """Copies ``tensors`` one after another into the 1-d scratch buffer ``flat``. Detached:
    autograd refuses ``cat(out=...)`` of inputs that require grad, and packing is this
    library's own step, of which gloo has no autograd-visible counterpart."""
    if tensors:
        torch.cat([t.detach().reshape(-1) for t in tensors], out=flat)


def _unpack(flat, tensors):
    """Copies consecutive pieces of ``flat`` into ``tensors``, in list order."""
    off = 0
    for t in tensors:
        t.copy_(flat[off : off + t.numel()].view(t.shape))
        off += t.numel()


def _same_kind(tensors, what):
    """The rule of gloo for the tensors of one rank in one call: one layout, dtype, device and
    shape (RuntimeError naming the first that differs)."""
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.layout != first.layout:
            raise RuntimeError(
                f"comm: {what}: invalid tensor layout at index {i} (expected {first.layout}, got {t.layout})"
            )
        if t.dtype != first.dtype or t.device != first.device:
            raise RuntimeError(
                f"comm: {what}: invalid tensor type at index {i} (expected {first.dtype} on {first.device}, "
                f"got {t.dtype} on {t.device})"
            )
        if t.shape != first.shape:
            raise RuntimeError(
                f"comm: {what}: invalid tensor size at index {i} (expected {tuple(first.shape)}, got {tuple(t.shape)})"
            )


# How several tensors of one rank combine before the all-reduce (all_reduce_joint). AVG and
# PREMUL_SUM are linear, so the tensors add up first and the op applies once, across ranks;
# gloo divides an AVG by the number of ranks only, and so does this.
_FOLDS = {
    "sum": lambda acc, t: acc.add_(t),
    "avg": lambda acc, t: acc.add_(t),
    "premul_sum": lambda acc, t: acc.add_(t),
    "product": lambda acc, t: acc.mul_(t),
    "min": lambda acc, t: torch.minimum(acc, t, out=acc),
    "max": lambda acc, t: torch.maximum(acc, t, out=acc),
    "band": lambda acc, t: acc.bitwise_and_(t),
    "bor": lambda acc, t: acc.bitwise_or_(t),
    "bxor": lambda acc, t: acc.bitwise_xor_(t),
}


class Engine:
    """One libcomm communicator and the operations on it."""

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
        engine = Engine(self.lib, child, rank.value, count.value, name)
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
    def _submit(
        self,
        tensors,
        stream_box,
        issue,
        finish=None,
        cleanup=None,
        result=None,
        async_op=False,
        keep=(),
        p2p=False,
        alone=False,
    ):
        """Wraps the calls of one operation in a Task and runs it (or records it while
        coalescing). ``stream_box[0]`` receives the stream handle the calls must pass;
        ``keep`` lists the buffers the calls point into besides ``tensors``."""
        cuda = self._cuda_context(tensors, keep)
        if cuda is not None:
            stream_box[0] = cuda[1].cuda_stream
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

    # ------------------------------------------------------------------------------------
    # Operations. Each returns a CommWork whose future yields ``result``.

    def all_reduce(self, tensor, op=SUM, async_op=False, result=None):
        if (
            not async_op
            and self._coalescing is None
            and not self._p2p
            and not self._anys
            and not getattr(_deferred, "engines", None)
            and tensor.is_cpu
            and tensor.is_contiguous()
        ):
            # The common synchronous case in as few Python steps as possible: small
            # all-reduces are bound by this overhead, not by the library.
            code, opcode = _DTYPES.get(tensor.dtype), _OPS.get(op.kind)
            if code is not None and opcode is not None and self.executor.enter_inline():
                try:
                    ptr = tensor.data_ptr()
                    r = self._all_reduce(ptr, ptr, tensor.numel(), code, opcode, self.handle, None)
                finally:
                    self.executor.exit_inline()
                if r:
                    self.lib.check(r, "ncclAllReduce", self.handle)
                return DONE if result is None else CommWork(result, done=True)
        buf, staged = self._dense(tensor)
        opcode, cleanup, as_real, code = self._reducer(buf.dtype, op)
        view = torch.view_as_real(buf) if as_real else buf
        ptr, count = view.data_ptr(), view.numel()
        lib, handle = self.lib, self.handle
        stream = [None]

        def issue():
            r = lib.ncclAllReduce(ptr, ptr, count, code, opcode(), handle, stream[0])
            if r:
                lib.check(r, "ncclAllReduce", handle)

        return self._submit(
            [tensor], stream, issue, self._copy_back(staged, tensor, buf), cleanup, result, async_op, keep=(buf, view)
        )

    def sparse_all_reduce(self, tensor, op=SUM, async_op=False, result=None):
        """All-reduce of a sparse COO tensor, the way gloo does it: every rank's indices and
        values are gathered, then coalescing sums the entries that share an index. Only SUM
        is defined on sparse tensors (gloo refuses the others too). The result replaces the
        tensor's contents. It runs before returning, so the work is already complete."""
        if tensor.layout != torch.sparse_coo:
            raise RuntimeError(f"comm: sparse all_reduce takes sparse COO tensors, got layout {tensor.layout}")
        if op.kind != "sum":
            raise RuntimeError(f"comm: sparse all_reduce supports ReduceOp.SUM only, got {op.kind}")
        self.flush_p2p()
        local = tensor.coalesce()
        # (nnz, sparse_dim) and (nnz, *dense dims): the entries are rows, gathered by rows.
        indices = local.indices().t().contiguous()
        values = local.values().contiguous()
        counts = torch.empty(self.size, dtype=torch.int64)
        self.all_gather_single(counts, torch.tensor([indices.shape[0]], dtype=torch.int64)).wait()
        counts = counts.tolist()
        most = max(counts)

        def gather_rows(rows):
            # Every rank contributes ``most`` rows (padding after its own), so one all-gather does.
            padded = rows.new_zeros((most,) + tuple(rows.shape[1:]))
            padded[: rows.shape[0]] = rows
            out = rows.new_empty((self.size * most,) + tuple(rows.shape[1:]))
            self.all_gather_single(out, padded).wait()
            return torch.cat([out[r * most : r * most + counts[r]] for r in range(self.size)])

        if most:
            summed = torch.sparse_coo_tensor(
                gather_rows(indices).t(), gather_rows(values), tensor.shape, dtype=tensor.dtype
            ).coalesce()
        else:
            summed = torch.sparse_coo_tensor(indices.t(), values, tensor.shape, dtype=tensor.dtype).coalesce()
        tensor.copy_(summed)
        return completed_work([tensor] if result is None else result)

    def all_reduce_coalesced(self, tensors, op=SUM, async_op=False, result=None):
        """Several tensors reduced the way gloo does it: packed into one buffer (one per dtype
        and device), each buffer all-reduced once, the results copied back in list order. A
        tensor listed twice, or views that overlap, are so reduced once, as with gloo; a group
        of in-place all-reduces reduced an aliased tensor once per appearance."""
        for i, t in enumerate(tensors):
            if t.layout != torch.strided:
                raise RuntimeError(f"comm: all_reduce_coalesced takes dense tensors; tensor {i} is {t.layout}")
        if len(tensors) == 1:
            return self.all_reduce(tensors[0], op, async_op, result)
        kinds = {}
        for t in tensors:
            kinds.setdefault((t.dtype, t.device), []).append(t)

        def build():
            for (dtype, device), members in kinds.items():
                flat = torch.empty((sum(t.numel() for t in members),), dtype=dtype, device=device)
                self._wrapped(
                    lambda flat=flat: self.all_reduce(flat, op),
                    lambda flat=flat, members=members: _pack(members, flat),
                    lambda flat=flat, members=members: _unpack(flat, members),
                )

        return self.group(build, tensors if result is None else result, async_op)

    def all_reduce_joint(self, tensors, op=SUM, async_op=False, result=None):
        """Several tensors of one shape and dtype on each rank (one per device, in the
        ProcessGroup API's old multi-device form), reduced jointly as gloo does: all of them,
        on every rank, into one result that every tensor receives. Dense tensors are folded
        into one buffer first and that is all-reduced; sparse ones are summed, then reduced as
        one (see sparse_all_reduce)."""
        _same_kind(tensors, "all_reduce")
        if tensors[0].layout == torch.sparse_coo:
            if op.kind != "sum":
                raise RuntimeError(f"comm: sparse all_reduce supports ReduceOp.SUM only, got {op.kind}")
            with torch.no_grad():
                total = tensors[0].clone()
                for t in tensors[1:]:
                    total = total + t
                self.sparse_all_reduce(total, op)
                for t in tensors:
                    t.copy_(total)
            return completed_work(tensors if result is None else result)
        fold = _FOLDS.get(op.kind)
        if fold is None:
            raise RuntimeError(f"comm: all_reduce of several tensors per rank does not support {op.kind}")
        acc = torch.empty(tensors[0].shape, dtype=tensors[0].dtype, device=tensors[0].device)

        # Detached: gloo folds and writes these tensors in C++, where autograd sees nothing
        # (its leaves that require grad take the result, for one).
        def before():
            acc.copy_(tensors[0].detach())
            for t in tensors[1:]:
                fold(acc, t.detach())

        def after():
            for t in tensors:
                t.detach().copy_(acc)

        return self._wrapped(
            lambda: self.all_reduce(acc, op), before, after, tensors if result is None else result, async_op
        )

    def broadcast(self, tensor, root, async_op=False, result=None):
        self._peer(root, "root")
        buf, staged = self._dense(tensor)
        code, count = self._movable(buf)
        ptr = buf.data_ptr()
        lib, handle = self.lib, self.handle
        stream = [None]

        def issue():
            r = lib.ncclBroadcast(ptr, ptr, count, code, root, handle, stream[0])
            if r:
                lib.check(r, "ncclBroadcast", handle)

        finish = self._copy_back(staged and self.rank != root, tensor, buf)
        return self._submit([tensor], stream, issue, finish, None, result, async_op, keep=(buf,))

    def broadcast_joint(self, tensors, root, root_tensor=0, async_op=False, result=None):
        """Several tensors per rank (the multi-device form): tensor ``root_tensor`` of the
        root reaches every tensor of every rank, as with gloo."""
        _same_kind(tensors, "broadcast")
        if not 0 <= root_tensor < len(tensors):
            raise RuntimeError(f"comm: broadcast: invalid root tensor: {root_tensor} (a list of {len(tensors)})")
        result = tensors if result is None else result
        if len(tensors) == 1:
            return self.broadcast(tensors[0], root, async_op, result)
        source = tensors[root_tensor]

        def after():
            for i, t in enumerate(tensors):
                if i != root_tensor:
                    t.copy_(source)

        return self._wrapped(lambda: self.broadcast(source, root), None, after, result, async_op)

    def reduce(self, tensor, root, op=SUM, async_op=False, result=None):
        self._peer(root, "root")
        buf, staged = self._dense(tensor)
        opcode, cleanup, as_real, code = self._reducer(buf.dtype, op)
        view = torch.view_as_real(buf) if as_real else buf
        ptr, count = view.data_ptr(), view.numel()
        lib, handle = self.lib, self.handle
        stream = [None]

        def issue():
            r = lib.ncclReduce(ptr, ptr, count, code, opcode(), root, handle, stream[0])
            if r:
                lib.check(r, "ncclReduce", handle)

        finish = self._copy_back(staged and self.rank == root, tensor, buf)
        return self._submit([tensor], stream, issue, finish, cleanup, result, async_op, keep=(buf, view))

    def all_gather_single(self, output, input, async_op=False, result=None):
        if output.numel() != input.numel() * self.size or output.dtype != input.dtype:
            raise RuntimeError(
                f"comm: all_gather output must hold {self.size} x {input.numel()} elements of "
                f"{input.dtype}, got {output.numel()} of {output.dtype}"
            )
        inp, _ = self._dense(input)
        out, staged = self._dense(output)
        code, count = self._movable(inp)
        sptr, rptr = inp.data_ptr(), out.data_ptr()
        lib, handle = self.lib, self.handle
        stream = [None]

        def issue():
            r = lib.ncclAllGather(sptr, rptr, count, code, handle, stream[0])
            if r:
                lib.check(r, "ncclAllGather", handle)

        return self._submit(
            [output, input],
            stream,
            issue,
            self._copy_back(staged, output, out),
            None,
            result,
            async_op,
            keep=(inp, out),
        )

    def all_gather(self, outputs, input, async_op=False, result=None):
        """Into a list of tensors: one ncclAllGather into a flat buffer, copied out; tensors
        of different sizes take a group of broadcasts instead."""
        n = self.size
        if len(outputs) != n:
            raise RuntimeError(f"comm: all_gather needs {n} output tensors, got {len(outputs)}")
        for o in outputs:
            if o.dtype != input.dtype:
                raise RuntimeError(f"comm: all_gather output dtype {o.dtype} differs from the input's {input.dtype}")
        result = outputs if result is None else result
        numel = input.numel()
        if all(o.numel() == numel for o in outputs):
            flat = torch.empty((n * numel,), dtype=input.dtype, device=input.device)
            src = input.reshape(-1) if input.is_contiguous() else input

            def after():
                parts = flat.view(n, numel)
                for i, o in enumerate(outputs):
                    o.copy_(parts[i].view(o.shape))

            return self._wrapped(lambda: self.all_gather_single(flat, src), None, after, result, async_op)
        if outputs[self.rank].numel() != numel:
            raise RuntimeError("comm: all_gather output for this rank must match the input's size")

        # This rank broadcasts from a dense buffer it fills when the group runs, then copies
        # into its own output: broadcasting from that output took a staged copy of a
        # non-contiguous one before the input was copied in, and sent zeros.
        mine = torch.empty(input.shape, dtype=input.dtype, device=input.device)

        def build():
            for i, o in enumerate(outputs):
                if i == self.rank:
                    self._wrapped(
                        lambda i=i: self.broadcast(mine, i),
                        before=lambda: mine.copy_(input),
                        after=lambda o=o: o.copy_(mine.reshape(o.shape)),
                    )
                else:
                    self.broadcast(o, i)

        return self.group(build, result, async_op)

    def all_gather_joint(self, output_lists, inputs, async_op=False, result=None):
        """Several inputs per rank (the multi-device form), as gloo gathers them: every output
        list receives, for each rank in order, each of that rank's inputs in order."""
        k, n = len(inputs), self.size
        _same_kind(inputs, "all_gather")
        if len(output_lists) != k:
            raise RuntimeError(
                f"comm: all_gather: requires input/output tensor lists to have the same length "
                f"({k} inputs, {len(output_lists)} output lists)"
            )
        if k == 1:
            return self.all_gather(output_lists[0], inputs[0], async_op, result)
        numel, dtype = inputs[0].numel(), inputs[0].dtype
        for i, outs in enumerate(output_lists):
            if len(outs) != k * n:
                raise RuntimeError(
                    f"comm: all_gather: invalid output tensor list at index {i} (expected length {k * n}, got {len(outs)})"
                )
            for j, o in enumerate(outs):
                if o.dtype != dtype or o.numel() != numel:
                    raise RuntimeError(
                        f"comm: all_gather: output {j} of list {i} is {o.numel()} elements of {o.dtype}; with several "
                        f"inputs per rank every output must match the inputs ({numel} of {dtype})"
                    )
        send = torch.empty((k * numel,), dtype=dtype, device=inputs[0].device)
        recv = torch.empty((n * k * numel,), dtype=dtype, device=inputs[0].device)

        def after():
            for outs in output_lists:
                _unpack(recv, outs)

        return self._wrapped(
            lambda: self.all_gather_single(recv, send),
            lambda: _pack(inputs, send),
            after,
            output_lists if result is None else result,
            async_op,
        )

    def all_gather_coalesced(self, output_lists, inputs, async_op=False, result=None):
        """``output_lists[r][j]`` receives input ``j`` of rank ``r`` (torch's layout)."""
        if len(output_lists) != self.size or any(len(outs) != len(inputs) for outs in output_lists):
            raise RuntimeError(f"comm: all_gather_coalesced needs {self.size} output lists of {len(inputs)} tensors")

        def build():
            for j, inp in enumerate(inputs):
                self.all_gather([outs[j] for outs in output_lists], inp)

        return self.group(build, output_lists if result is None else result, async_op)

    def all_gather_single_coalesced(self, outputs, inputs, async_op=False, result=None):
        def build():
            for out, inp in zip(outputs, inputs):
                self.all_gather_single(out, inp)

        return self.group(build, outputs if result is None else result, async_op)

    def reduce_scatter_single(self, output, input, op=SUM, async_op=False, result=None):
        if input.numel() != output.numel() * self.size or output.dtype != input.dtype:
            raise RuntimeError(
                f"comm: reduce_scatter input must hold {self.size} x {output.numel()} elements of "
                f"{output.dtype}, got {input.numel()} of {input.dtype}"
            )
        inp, _ = self._dense(input)
        out, staged = self._dense(output)
        opcode, cleanup, as_real, code = self._reducer(out.dtype, op)
        inv = torch.view_as_real(inp) if as_real else inp
        outv = torch.view_as_real(out) if as_real else out
        sptr, rptr, count = inv.data_ptr(), outv.data_ptr(), outv.numel()
        lib, handle = self.lib, self.handle
        stream = [None]

        def issue():
            r = lib.ncclReduceScatter(sptr, rptr, count, code, opcode(), handle, stream[0])
            if r:
                lib.check(r, "ncclReduceScatter", handle)

        return self._submit(
            [output, input],
            stream,
            issue,
            self._copy_back(staged, output, out),
            cleanup,
            result,
            async_op,
            keep=(inp, out, inv, outv),
        )

    def reduce_scatter(self, output, inputs, op=SUM, async_op=False, result=None):
        """From a list, ``inputs[r]`` reduced into rank r's output. Blocks of one size: packed
        into one buffer inside the task (so an async call returns at once), then one
        ncclReduceScatter. Blocks of different sizes (gloo takes them): one ncclReduce per
        rank, to that rank, all in one group."""
        n = self.size
        if len(inputs) != n:
            raise RuntimeError(f"comm: reduce_scatter needs {n} input tensors, got {len(inputs)}")
        for t in inputs:
            if t.dtype != output.dtype:
                raise RuntimeError("comm: reduce_scatter inputs must each match the output's size and dtype")
        if inputs[self.rank].numel() != output.numel():
            raise RuntimeError(
                f"comm: reduce_scatter input {self.rank} (this rank's block) has {inputs[self.rank].numel()} "
                f"elements, the output {output.numel()}; they must match"
            )
        result = [output] if result is None else result
        sizes = [t.numel() for t in inputs]
        flat = torch.empty((sum(sizes),), dtype=output.dtype, device=output.device)
        if len(set(sizes)) == 1:
            return self._wrapped(
                lambda: self.reduce_scatter_single(output, flat, op),
                lambda: _pack(inputs, flat),
                None,
                result,
                async_op,
            )
        starts = [sum(sizes[:r]) for r in range(n)]
        mine = flat[starts[self.rank] : starts[self.rank] + sizes[self.rank]]

        def build():
            for r in range(n):
                block = flat[starts[r] : starts[r] + sizes[r]]
                self._wrapped(
                    lambda block=block, r=r: self.reduce(block, r, op),
                    # Packed before any reduce of the group runs: a group runs its calls at its end.
                    (lambda: _pack(inputs, flat)) if r == 0 else None,
                    (lambda: output.copy_(mine.view(output.shape))) if r == self.rank else None,
                )

        return self.group(build, result, async_op)

    def reduce_scatter_single_coalesced(self, outputs, inputs, op=SUM, async_op=False, result=None):
        def build():
            for out, inp in zip(outputs, inputs):
                self.reduce_scatter_single(out, inp, op)

        return self.group(build, outputs if result is None else result, async_op)

    def all_to_all_single(self, output, input, output_splits=None, input_splits=None, async_op=False, result=None):
        """Without split sizes one ncclAlltoAll; with them (rows of dim 0) one commAlltoAllv."""
        if output.dtype != input.dtype:
            raise RuntimeError(f"comm: all_to_all output dtype {output.dtype} differs from the input's {input.dtype}")
        if not input.is_contiguous():
            # As gloo and NCCL refuse it (ValueError, their words): split sizes count rows of
            # the input as laid out in memory.
            raise ValueError("comm: all_to_all_single: Tensors must be contiguous (the input is not)")
        n = self.size
        inp, _ = self._dense(input)
        out, staged = self._dense(output)
        code, _ = self._movable(inp)
        unit = inp.element_size() if (code == _lib.UINT8 and _DTYPES.get(inp.dtype) is None) else 1
        sptr, rptr = inp.data_ptr(), out.data_ptr()
        lib, handle = self.lib, self.handle
        stream = [None]
        if not output_splits and not input_splits:
            if inp.numel() != out.numel() or inp.numel() % n:
                raise RuntimeError(
                    f"comm: all_to_all_single without split sizes needs input and output of one size "
                    f"divisible by {n}, got {inp.numel()} and {out.numel()}"
                )
            count = inp.numel() // n * unit

            def issue():
                r = lib.ncclAlltoAll(sptr, rptr, count, code, handle, stream[0])
                if r:
                    lib.check(r, "ncclAlltoAll", handle)

        else:
            in_rows = inp.shape[0] if inp.dim() else 1
            out_rows = out.shape[0] if out.dim() else 1
            in_row = inp.numel() // in_rows if in_rows else 0
            out_row = out.numel() // out_rows if out_rows else 0
            in_splits = [int(s) for s in input_splits] if input_splits else [in_rows // n] * n
            out_splits = [int(s) for s in output_splits] if output_splits else [out_rows // n] * n
            if len(in_splits) != n or len(out_splits) != n:
                raise RuntimeError(f"comm: all_to_all_single split sizes need {n} entries")
            if sum(in_splits) != in_rows or sum(out_splits) != out_rows:
                raise RuntimeError(
                    f"comm: split sizes {in_splits} and {out_splits} do not add up to the first "
                    f"dimensions {in_rows} and {out_rows}"
                )
            arr = ctypes.c_size_t * n
            scounts, sdispls, rcounts, rdispls = arr(), arr(), arr(), arr()
            off = 0
            for p, s in enumerate(in_splits):
                scounts[p], sdispls[p] = s * in_row * unit, off * in_row * unit
                off += s
            off = 0
            for p, s in enumerate(out_splits):
                rcounts[p], rdispls[p] = s * out_row * unit, off * out_row * unit
                off += s

            def issue():
                r = lib.commAlltoAllv(sptr, scounts, sdispls, rptr, rcounts, rdispls, code, handle, stream[0])
                if r:
                    lib.check(r, "commAlltoAllv", handle)

        return self._submit(
            [output, input],
            stream,
            issue,
            self._copy_back(staged, output, out),
            None,
            result,
            async_op,
            keep=(inp, out),
        )

    def all_to_all(self, outputs, inputs, async_op=False, result=None):
        """Lists: inputs packed into one buffer, one ncclAlltoAll (one block size) or
        commAlltoAllv, outputs copied out of one buffer; all in one task."""
        n = self.size
        if len(outputs) != n or len(inputs) != n:
            raise RuntimeError(f"comm: all_to_all needs {n} input and {n} output tensors")
        dtype, device = inputs[0].dtype, inputs[0].device
        if any(t.dtype != dtype for t in list(inputs) + list(outputs)):
            raise RuntimeError("comm: all_to_all tensors must share one dtype")
        send = torch.empty((sum(t.numel() for t in inputs),), dtype=dtype, device=device)
        recv = torch.empty((sum(t.numel() for t in outputs),), dtype=dtype, device=device)
        in_splits = [t.numel() for t in inputs]
        out_splits = [t.numel() for t in outputs]
        uniform = len(set(in_splits + out_splits)) == 1

        make = lambda: self.all_to_all_single(
            recv, send, None if uniform else out_splits, None if uniform else in_splits
        )
        return self._wrapped(
            make,
            lambda: _pack(inputs, send),
            lambda: _unpack(recv, outputs),
            outputs if result is None else result,
            async_op,
        )

    def gather_single(self, output, input, root, async_op=False, result=None, outputs=None):
        """ncclGather into ``output`` (root only); ``outputs`` gets it copied out as a list."""
        self._peer(root, "root")
        inp, _ = self._dense(input)
        code, count = self._movable(inp)
        is_root = self.rank == root
        if is_root:
            if output is None or output.numel() != inp.numel() * self.size or output.dtype != inp.dtype:
                raise RuntimeError(
                    f"comm: gather output on the root must hold {self.size} x {inp.numel()} elements of {inp.dtype}"
                )
            out, staged = self._dense(output)
            rptr = out.data_ptr()
        else:
            out, staged, rptr = None, False, None
        sptr = inp.data_ptr()
        lib, handle = self.lib, self.handle
        stream = [None]

        def issue():
            r = lib.ncclGather(sptr, rptr, count, code, root, handle, stream[0])
            if r:
                lib.check(r, "ncclGather", handle)

        def finish():
            if staged:
                output.copy_(out)
            if outputs is not None:
                parts = out.view(self.size, -1)
                for i, o in enumerate(outputs):
                    o.copy_(parts[i].view(o.shape))

        tensors = [input] + ([output] if is_root else [])
        return self._submit(
            tensors, stream, issue, finish if is_root else None, None, result, async_op, keep=(inp, out)
        )

    def gather(self, outputs, input, root, async_op=False, result=None):
        """Into a list on the root: one ncclGather into a flat buffer, copied out."""
        self._peer(root, "root")
        flat = None
        if self.rank == root:
            if len(outputs) != self.size:
                raise RuntimeError(f"comm: gather needs {self.size} output tensors on the root, got {len(outputs)}")
            for o in outputs:
                if o.numel() != input.numel() or o.dtype != input.dtype:
                    raise RuntimeError("comm: gather outputs must match the input's size and dtype")
            flat = torch.empty((self.size * input.numel(),), dtype=input.dtype, device=input.device)
        return self.gather_single(
            flat, input, root, async_op, outputs if result is None else result, outputs if flat is not None else None
        )

    def scatter(self, output, inputs, root, async_op=False, result=None):
        """ncclScatter from one buffer the root packs from ``inputs`` inside the task."""
        self._peer(root, "root")
        out, staged = self._dense(output)
        code, count = self._movable(out)
        is_root = self.rank == root
        send = None
        if is_root:
            if len(inputs) != self.size:
                raise RuntimeError(f"comm: scatter needs {self.size} input tensors on the root, got {len(inputs)}")
            for t in inputs:
                if t.numel() != out.numel() or t.dtype != out.dtype:
                    raise RuntimeError("comm: scatter inputs must match the output's size and dtype")
            send = torch.empty((self.size * out.numel(),), dtype=out.dtype, device=out.device)
        sptr = send.data_ptr() if send is not None else None
        rptr = out.data_ptr()
        lib, handle = self.lib, self.handle
        stream = [None]

        def issue():
            if send is not None:
                _pack(inputs, send)
            r = lib.ncclScatter(sptr, rptr, count, code, root, handle, stream[0])
            if r:
                lib.check(r, "ncclScatter", handle)

        tensors = [output] + (list(inputs) if is_root else [])
        return self._submit(
            tensors,
            stream,
            issue,
            self._copy_back(staged, output, out),
            None,
            [output] if result is None else result,
            async_op,
            keep=(out, send),
        )

    def send(self, tensor, peer, async_op=False, result=None):
        if self._p2p_side is not None:
            return self._p2p_side.send(tensor, peer, async_op, result)
        self._peer(peer, "destination rank")
        buf, _ = self._dense(tensor)
        code, count = self._movable(buf)
        ptr = buf.data_ptr()
        lib, handle = self.lib, self.handle
        stream = [None]

        def issue():
            r = lib.ncclSend(ptr, count, code, peer, handle, stream[0])
            if r:
                lib.check(r, "ncclSend", handle)

        return self._submit([tensor], stream, issue, None, None, result, async_op, keep=(buf,), p2p=True)

    def recv(self, tensor, peer, async_op=False, result=None):
        if self._p2p_side is not None:
            return self._p2p_side.recv(tensor, peer, async_op, result)
        self._peer(peer, "source rank")
        buf, staged = self._dense(tensor)
        code, count = self._movable(buf)
        ptr = buf.data_ptr()
        lib, handle = self.lib, self.handle
        stream = [None]

        def issue():
            r = lib.ncclRecv(ptr, count, code, peer, handle, stream[0])
            if r:
                lib.check(r, "ncclRecv", handle)

        finish = self._copy_back(staged, tensor, buf)
        return self._submit([tensor], stream, issue, finish, None, result, async_op, keep=(buf,), p2p=True)

    def recv_any_source(self, tensor, async_op=False, result=None):
        """commRecvAny: the next point-to-point message of this size from any rank; the work's
        source_rank() tells which. Deferred like the other sends and receives, it runs on its
        own after their group (it cannot join it: its source is chosen when it runs)."""
        if self._p2p_side is not None:
            return self._p2p_side.recv_any_source(tensor, async_op, result)
        if self._coalescing is not None:
            raise RuntimeError("comm: a receive from any source cannot be coalesced: its source is chosen when it runs")
        buf, staged = self._dense(tensor)
        code, count = self._movable(buf)
        ptr = buf.data_ptr()
        lib, handle = self.lib, self.handle
        source = ctypes.c_int(-1)
        stream = [None]

        def issue():
            r = lib.commRecvAny(ptr, count, code, _byref(source), handle, stream[0])
            if r:
                lib.check(r, "commRecvAny", handle)

        finish = self._copy_back(staged, tensor, buf)
        # Deferred like the other point-to-point calls, and started after them: a pending
        # receive from any source held the group's executor, so an isend posted after it
        # never left (rank 0: irecv from any source, isend to rank 1, which receives first).
        work = self._submit(
            [tensor], stream, issue, finish, None, result, async_op, keep=(buf, source), p2p=True, alone=True
        )
        work._source = source
        return work

    def barrier(self, async_op=False, timeout=None, result=None):
        """A one-element all-reduce on host memory, so a dead peer fails it like any collective.

        With ``timeout`` (seconds), a barrier still incomplete that long after it was issued
        fails: a peer that never arrives leaves this rank's library call blocked, so the
        communicator is aborted (which unblocks it, as NCCL's watchdog does on a timeout) and
        wait() raises an error that says the barrier timed out. Later operations on the
        communicator fail."""
        if timeout is None:
            return self.all_reduce(torch.zeros(1, dtype=torch.float32), SUM, async_op, result)
        work = self.all_reduce(torch.zeros(1, dtype=torch.float32), SUM, async_op=True, result=result)
        ms = round(timeout * 1000)

        def expire():
            self.abort()
            return CommError(
                f"comm: rank {self.rank} of group {self.name!r} ({self.size} ranks): barrier exceeded its timeout of {ms} ms (Timed out "
                f"waiting for the other ranks to arrive); the communicator was aborted, so its later "
                f"operations fail",
                call="barrier",
            )

        if not work._done:
            work._deadline = time.monotonic() + timeout
            work._expire = expire
        if not async_op:
            work.wait()
        return work
