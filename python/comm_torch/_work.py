"""What an operation returns, and the executor that runs one communicator's operations.

The executor keeps every call on a communicator in issue order: a synchronous call with
nothing in flight runs inline in the caller's thread (the fast path for small messages);
anything else goes to a worker thread, so ``async_op=True`` returns before the data moves.
ctypes releases the GIL while libcomm runs, so the caller's Python thread keeps going.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
import weakref
from typing import Any

import torch

from ._lib import CommError

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
# Point-to-point calls deferred until something needs them (Engine._dispatch).

# Per thread: the engines holding point-to-point calls this thread deferred (Engine._dispatch).
_deferred = threading.local()


def _deferred_here() -> weakref.WeakSet:
    engines = getattr(_deferred, "engines", None)
    if engines is None:
        engines = _deferred.engines = weakref.WeakSet()
    return engines


def flush_deferred_p2p() -> None:
    """Starts the point-to-point calls this thread deferred, on every communicator: an
    operation on one group must not leave an isend on another unsent (rank 0 isends on the
    world, then all-reduces on a subgroup while rank 1 receives on the world first: that
    deadlocked, the send waiting for a wait or another operation on the world)."""
    for engine in list(_deferred_here()):
        engine.flush_p2p()
